"""What a Megatron rank imports (seconds of CPU: docs/results.md), for the local ranks' fork server to import once
per driver (MegatronTrainer.rank_imports, relax.cluster.ranks.rank_context), without the
"Apex/TE not installed" warnings that each rank silences (trainer.py)."""

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", module=r"megatron\.")
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
