"""debug.dump_layers for rollout=sglang: module outputs recorded inside SGLang's scheduler.

`record_modules` runs there as a custom weight loader (`SGLangEngine._run`): "start" hooks
the served model's modules by name, "stop" writes what each returned in every forward since
to <dir>/tp<rank>.pt and removes the hooks. `record` drives it: each sequence prefilled alone
(the prefix cache dropped first, so every position is computed), one new token, greedy.
"""

from __future__ import annotations

import json
import tempfile

import torch

RECORD_MODULES = f"{__name__}.record_modules"  # the loader's name in custom_weight_loader
_recording: dict = {"hooks": [], "outputs": {}}  # (the scheduler process's, between two calls)


def loader_argument(named_tensors) -> str:
    """The string a Relax loader was called with (`SGLangEngine._run`'s one uint8 tensor)."""
    (_, encoded), = named_tensors
    return bytes(encoded.tolist()).decode()


def layer_output(name: str, output, args: tuple) -> torch.Tensor:
    """A module's output as transformers' module returns it. SGLang's decoder layer (an entry
    of a ModuleList: its name ends in its index) returns its MLP's output, the residual stream
    before it kept in the forward batch's `residual_stream` (in older SGLang, the pair): their
    sum is transformers' layer output. Another module returning a tuple (the final norm given a
    residual: the normed output, the residual) returns its output first."""
    output = getattr(output, "next_token_logits", output)  # (the logits processor's)
    if not name.rsplit(".", 1)[-1].isdigit():
        return output[0] if isinstance(output, tuple) else output
    if isinstance(output, tuple):
        output, residual = output[0], output[1] if len(output) > 1 else None
    else:
        stream = getattr(args[2], "residual_stream", None) if len(args) > 2 else None
        residual = getattr(stream, "residual", None)
    if residual is None or residual.shape != output.shape:
        return output
    return output + residual.to(output.dtype)


def record_modules(model, named_tensors) -> None:
    """In the scheduler: {"action": "start", "names": [...]} hooks those modules of the served
    model (names it lacks are skipped); {"action": "stop", "dir": ...} saves and unhooks."""
    # optional: sglang (its own environment: scripts/setup_sglang_cpu.sh)
    from sglang.srt.runtime_context import get_parallel

    request = json.loads(loader_argument(named_tensors))
    for handle in _recording["hooks"]:
        handle.remove()
    _recording["hooks"] = []
    if request["action"] == "stop":
        torch.save(_recording["outputs"], f"{request['dir']}/tp{get_parallel().tp_rank}.pt")
        _recording["outputs"] = {}
        return
    _recording["outputs"] = outputs = {}
    modules = dict(model.named_modules())

    def hook(name):
        def take(module, args, output):
            outputs.setdefault(name, []).append(layer_output(name, output, args).detach().float().cpu().clone())
        return take

    for name in request["names"]:
        if name in modules:
            _recording["hooks"].append(modules[name].register_forward_hook(hook(name)))


def record(engine, run, sequences: list[list[int]], names: list[str]) -> dict[str, list[torch.Tensor]]:
    """Each sequence prefilled alone in `engine` (an sglang.Engine; `run(loader, argument)`
    calls a loader in its scheduler), the outputs of the modules `names` recorded: per name,
    one [len, ...] fp32 tensor per sequence (a chunked prefill's pieces joined)."""
    out: dict[str, list[torch.Tensor]] = {}
    params = {"temperature": 0.0, "max_new_tokens": 1}
    for tokens in sequences:
        engine.flush_cache()
        run(RECORD_MODULES, json.dumps({"action": "start", "names": names}))
        try:
            engine.generate(input_ids=[tokens], sampling_params=params)
        finally:
            with tempfile.TemporaryDirectory(prefix="relax-sglang-layers-") as tmp:
                run(RECORD_MODULES, json.dumps({"action": "stop", "dir": tmp}))
                recorded = torch.load(f"{tmp}/tp0.pt")
        for name, pieces in recorded.items():
            out.setdefault(name, []).append(torch.cat(pieces)[:len(tokens)])
    return out
