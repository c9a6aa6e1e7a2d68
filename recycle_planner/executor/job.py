"""What a user hands the executor: stage modules, a loss, an optimizer factory, data, a library.

A `Job` is built in every worker process (the launcher starts one process per worker and each
calls the user's job factory), so it holds *factories* where building is expensive: a worker
builds only its own stage. The same job reference (`file.py:function` or `module:function`)
serves `recycle-planner profile` and `recycle-planner launch`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from recycle_planner.errors import RecycleError

if TYPE_CHECKING:  # torch is an optional dependency of the package
    import torch

    from recycle_planner.executor.data.shapes import DynamicDims

DataFn = Callable[[int, int, int], tuple[Any, Any]]
AUTOCAST = (None, "bfloat16", "float16")


@dataclass
class Job:
    """One hybrid-parallel training job.

    - `stages[s]`: stage s as an `nn.Module`, or a function that builds it. Every worker of
      stage s must start from the same parameters; the executor copies the lowest-ranked
      worker's parameters to its peers at start, so a factory need not be seeded.
    - `loss_fn(output, target)`: the loss of one micro-batch (a mean over its samples). The
      executor scales every micro-batch loss by 1/(D*M) and sums gradients over the stage's
      live workers, so the step is the same whoever runs which micro-batch.
    - `optimizer(params)`: builds a stage's optimizer.
    - `data(iteration, pipeline, microbatch) -> (input, target)`: deterministic. `pipeline` is
      the *logical* pipeline of the plan, so the global batch of an iteration is the same
      whatever the failures; a redone iteration reads the same data again.
    - `iterations`: how many optimizer steps to train.
    - `library`: the plan library folder (`recycle-planner plan-all`); the launcher's
      `--library` overrides it.
    - `scheduler(optimizer)`: builds a stage's LR scheduler (stepped after every optimizer
      step, undone with it, copied and checkpointed with it), or None.
    - `step_hook`: a `hooks.StepHook` run between the gradient all-reduce and the optimizer
      step with a value summed over all stages (`hooks.ClipGradNorm` clips by the global
      norm; a `hooks.Validated` hook steps without waiting for the sum and is checked when
      it arrives), or None.
    - `autocast`: "bfloat16" or "float16" to run forwards under `torch.autocast` (parameters,
      gradients and optimizer stay in their own dtype), or None.

    - `dynamic`: a `shapes.DynamicDims` naming the boundary dims whose sizes vary with the
      data (a sequence length per batch), their maxima and a function giving their sizes per
      micro-batch; None (the default) for shapes fixed for the run.

    Stage inputs and outputs may be a tensor or a tuple, list or dict of tensors (a tuple is
    passed as positional arguments, a dict as keyword arguments); their shapes are read from
    the first sample and fixed for the run, unless `dynamic` says which dims vary.
    """

    stages: Sequence[Any]
    loss_fn: Callable[[Any, Any], Any]
    optimizer: Callable[[Iterable[Any]], Any]
    data: DataFn
    iterations: int
    library: str | Path | None = None
    scheduler: Callable[[Any], Any] | None = None
    step_hook: Any = None
    autocast: str | None = None
    dynamic: "DynamicDims | None" = None

    def __post_init__(self) -> None:
        if self.autocast not in AUTOCAST:
            raise RecycleError(f"autocast must be one of {', '.join(map(str, AUTOCAST))}, "
                               f"got {self.autocast!r}")
        if not self.stages:
            raise RecycleError("a job needs at least one stage")
        if isinstance(self.iterations, bool) or not isinstance(self.iterations, int) \
                or self.iterations < 1:
            raise RecycleError(f"a job needs a positive whole number of iterations, got "
                               f"{self.iterations!r}")

    def build_stage(self, stage: int) -> "torch.nn.Module":
        import torch

        item = self.stages[stage]
        if not isinstance(item, torch.nn.Module) and not callable(item):
            raise RecycleError(f"stage {stage} of the job is {type(item).__name__}, not a "
                               f"torch.nn.Module or a function that builds one")
        module = item if isinstance(item, torch.nn.Module) else item()
        if not isinstance(module, torch.nn.Module):
            raise RecycleError(f"stage {stage} of the job is not a torch.nn.Module (its factory "
                               f"returned {type(module).__name__})")
        return module

    def build_state(self, module: "torch.nn.Module"):
        """The stage's optimizer and LR scheduler (None without a `scheduler` factory)."""
        optimizer = self.optimizer(module.parameters())
        return optimizer, (self.scheduler(optimizer) if self.scheduler is not None else None)

    def autocast_dtype(self):
        import torch

        return None if self.autocast is None else getattr(torch, self.autocast)


def load_job(target: str, argv: Sequence[str] = ()) -> Job:
    """Import `path/to/file.py:function` or `package.module:function` and call the function
    (with the list `argv` as its one argument if it takes a positional argument) to get the
    `Job`."""
    if ":" not in target:
        raise RecycleError(f"job {target!r} must be FILE.py:FUNCTION or MODULE:FUNCTION")
    where, _, name = target.rpartition(":")
    module = _import(where)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise RecycleError(f"{where} has no function {name!r}")
    try:
        job = factory(list(argv)) if _takes_argument(factory) else factory()
    except Exception as exc:  # noqa: BLE001 - the user's code: one line, where it raised
        raise RecycleError(f"{target}: the job function raised {_raised(exc)}") from None
    if not isinstance(job, Job):
        raise RecycleError(f"{target} returned {type(job).__name__}, not a "
                           f"recycle_planner.executor.Job")
    return job


def _import(where: str):
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise RecycleError(f"job file {path} does not exist")
        name = f"_recycle_job_{abs(hash(str(path.resolve())))}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        # The script's folder is importable, as it is when the script runs as a program.
        sys.path.insert(0, str(path.resolve().parent))
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - the user's code: one line, where it raised
            del sys.modules[name]
            raise RecycleError(f"job file {path}: importing it raised {_raised(exc)}") from None
        return module
    try:
        return importlib.import_module(where)
    except ImportError as exc:
        raise RecycleError(f"cannot import {where}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module raised while importing
        raise RecycleError(f"cannot import {where}: importing it raised "
                           f"{_raised(exc)}") from None


def _raised(exc: BaseException) -> str:
    """`ValueError: boom (job.py, line 3)`: the exception and the last place it passed in the
    user's code (not in this package, not in the import machinery)."""
    import traceback

    where, message = "", str(exc)
    if isinstance(exc, SyntaxError) and exc.filename:
        where, message = f" ({Path(exc.filename).name}, line {exc.lineno})", exc.msg or ""
    else:
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if "importlib" not in f.filename and f.filename != __file__]
        if frames:
            where = f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno})"
    message = message.splitlines()[0] if message else ""
    return f"{type(exc).__name__}" + (f": {message}" if message else "") + where


def _takes_argument(func: Callable) -> bool:
    import inspect

    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
               for p in params)
