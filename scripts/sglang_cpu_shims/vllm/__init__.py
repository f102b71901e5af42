"""Stand-in for the ``vllm`` package, for Relax's SGLang CPU environment only.

SGLang 0.5.23 run with ``device="cpu"`` outside its official CPU mode imports
``vllm._custom_ops.rotary_embedding`` (and, on MoE models, a few other ops) as its
non-CUDA fallback kernels. This package provides those ops in pure PyTorch so that no
real vLLM (a ~0.5 GB download) is needed. It has no dist-info, so tools that check
``importlib.metadata`` for vLLM still see it as not installed.

scripts/setup_sglang_cpu.sh places this folder at the *end* of sys.path (through a
.pth file), so a real vLLM installed later takes precedence.
"""

__version__ = "0.0.0+relax.cpu.shim"
