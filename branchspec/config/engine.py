"""Engine sizing: `EngineConfig` (batch, pages, prefill chunks, execution path, device)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from branchspec.config.checks import ConfigError, ConfigTypeError, check_bool, check_int


def check_device(owner: str, value) -> str:
    """A device name the engine can run on, as given: "cpu", "cuda" or "cuda:N" (CUDA must
    be available and N one of its devices)."""
    if not isinstance(value, str):
        raise ConfigTypeError(f"{owner}.device must be a string such as 'cpu' or 'cuda', got {type(value).__name__}")
    import torch

    try:
        dev = torch.device(value)
    except RuntimeError:
        raise ConfigError(f"{owner}.device={value!r} is not a device name; use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{owner}.device={value!r}: only 'cpu' and 'cuda' are supported")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{owner}.device={value!r} but CUDA is not available here "
                             f"(torch {torch.__version__}, torch.cuda.is_available() is False); use 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"{owner}.device={value!r} but this machine has {torch.cuda.device_count()} "
                             f"CUDA device(s)")
    return value


@dataclass(frozen=True)
class EngineConfig:
    """Batch and memory sizing. page_size counts slots (tokens or entries) per page.

    num_pages: pages per state kind ("raw", "buf4", "ent4", ...; the kinds a model has are
    checked when the engine is built), given as a dict; kinds not named get room for
    max_batch_size requests of max_model_len tokens. Stored as sorted (kind, pages) pairs,
    so that an EngineConfig is a value: frozen, comparable and hashable (`dict(num_pages)`
    gives the mapping back).
    """

    max_batch_size: int = 64
    page_size: int = 16
    max_model_len: int | None = None  # default: the model's max_position
    num_pages: Mapping[str, int] | tuple[tuple[str, int], ...] = ()
    prefill_chunk_size: int = 256
    compile: bool = False             # the compiled fast path (execution/compiled.py); eager is the reference
    device: str = "cpu"               # "cpu", "cuda" or "cuda:N": where the model, its state and its steps run
    # Replay every step as a CUDA graph per batch bucket (execution/graphed.py); None: on a
    # GPU yes, on a CPU no. False on a GPU launches every kernel from Python (for debugging).
    cuda_graphs: bool | None = None

    def __post_init__(self) -> None:
        own = "EngineConfig"
        for name in ("max_batch_size", "page_size", "prefill_chunk_size"):
            object.__setattr__(self, name, check_int(own, name, getattr(self, name), minimum=1))
        if self.max_model_len is not None:
            object.__setattr__(self, "max_model_len",
                               check_int(own, "max_model_len", self.max_model_len, minimum=1))
        check_bool(own, "compile", self.compile)
        object.__setattr__(self, "device", check_device(own, self.device))
        if self.cuda_graphs is not None:
            check_bool(own, "cuda_graphs", self.cuda_graphs)
            if self.cuda_graphs and not self.device.startswith("cuda"):
                raise ConfigError(f"{own}.cuda_graphs=True needs a CUDA device, got device={self.device!r}")
        pages = self.num_pages
        if isinstance(pages, tuple):      # pairs, as stored (dataclasses.replace passes them back)
            pages = dict(pages)
        if not isinstance(pages, Mapping):
            raise ConfigTypeError(f"{own}.num_pages must be a dict of state kind -> page count, "
                                  f"got {type(self.num_pages).__name__}")
        for kind, n in pages.items():
            if not isinstance(kind, str):
                raise ConfigTypeError(f"{own}.num_pages keys must be state kind names, got {kind!r}")
            check_int(own, f"num_pages[{kind!r}]", n, minimum=1)
        object.__setattr__(self, "num_pages", tuple(sorted((k, int(n)) for k, n in pages.items())))

    @property
    def uses_cuda_graphs(self) -> bool:
        """Whether the engine replays its steps as CUDA graphs (`cuda_graphs`, resolved)."""
        return self.cuda_graphs if self.cuda_graphs is not None else self.device.startswith("cuda")
