"""The two halves of an in-place weight swap in a vLLM engine: the node writes a file, the workers read it.

vLLM's engine workers run in other processes. Tensors handed to `collective_rpc` would be pickled
(and the multiprocess path refuses them: "cannot pickle memoryview"), so the node writes the
version's full state to one safetensors file (`write_weights_file`, in /dev/shm where there is
one) and every worker runs `WeightFileLoader.astraflow_load_weights_file` on it (a method vLLM
mixes into its workers: `worker_extension_cls`, so `collective_rpc` names it and nothing is
pickled): vLLM's in-place `reload_weights` over the file's tensors in checkpoint format, which
re-packs fused and CPU-packed layers the way a fresh load does (the model's own `load_weights`
cannot write into layers already packed for the CPU kernels). This module is imported inside the
workers: it imports only torch and safetensors.
"""

from __future__ import annotations

from typing import Any


def write_weights_file(state: dict[str, Any], path: str) -> None:
    """Writes `state` (name -> torch tensor or numpy array) to the safetensors file `path`."""
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for name, value in state.items():
        t = value if isinstance(value, torch.Tensor) else torch.from_numpy(value)
        tensors[name] = t.detach().to("cpu").contiguous()
    save_file(tensors, path)


class WeightFileLoader:
    """Mixed into each vLLM worker (`worker_extension_cls`); `self` is the worker."""

    def astraflow_load_weights_file(self, path: str) -> int:
        """Reloads the model's weights in place from the safetensors file `path`; returns the
        number of tensors read."""
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return len(tensors)


WORKER_EXTENSION = f"{__name__}.WeightFileLoader"
LOAD_METHOD = "astraflow_load_weights_file"
