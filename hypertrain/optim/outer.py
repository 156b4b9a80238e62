"""The outer optimizers, a table (docs/concepts.md, "The outer optimizer"): each entry a component that
checks its config (`check`), declares what it keeps per parameter (`momentum`: the run state's fp32
buffer, saved as `outer_momentum`; `state_bytes`: the memory estimate's bytes) and builds its step over
some global weights (`build`: a `optim.outer_steps.OuterStep`, whose `state_dict` a checkpoint saves).

`outer_optimizer(outer)` is the run's: `outer.optimizer` names `nesterov` (the built-in) or the import
path of any torch.optim.Optimizer subclass (`TorchOptimizer`); under outer.schedule=async,
outer.arrivals.rule=delayed_nesterov picks that entry (naive: the optimizer's own step on each update's
mean). This module imports no torch until a torch optimizer is named, so a refusal made from the config
alone stays torch-free; the steps are built from `diloco.outer` (torch) when a run starts.
"""

from __future__ import annotations

import functools
import importlib
import json

from hypertrain.config import OuterConfig, UserError
from hypertrain.import_path import is_import_path
from hypertrain.schedule_table import schedule_entry

FLOAT_BYTES = 4  # the built-ins' buffers are fp32
NAMED = "nesterov, or the import path of a torch.optim.Optimizer subclass (e.g. torch.optim.Adam)"


class OuterOptimizer:
    """A table entry. `field`: the config field that picks it by `name`."""

    name = ""
    field = "outer.optimizer"
    momentum = False  # keeps an fp32 momentum buffer per parameter in the run state (`outer_momentum`)

    def check(self, outer: OuterConfig) -> None:
        """UserError (one line) for a setting it cannot run with: a built-in takes no
        outer.optimizer_args (its fields are outer.momentum and outer.nesterov)."""
        if outer.optimizer_args:
            given = json.dumps(outer.optimizer_args, separators=(",", ":"))
            raise UserError(
                f"outer.optimizer_args={given} with the built-in {self.name}: its fields are outer.lr, "
                "outer.momentum and outer.nesterov; valid: outer.optimizer_args={}, or outer.optimizer=the "
                "import path of a torch.optim.Optimizer subclass"
            )

    def state_bytes(self, outer: OuterConfig) -> float:
        """The bytes it keeps per parameter beside the weights it steps."""
        raise NotImplementedError

    def build(self, outer: OuterConfig, theta, momentum, replicas: int):
        """Its step over the global weights `theta` (views), with `momentum` (views of the run state's
        buffers of those parameters; {} for an entry that keeps none) and R = `replicas`."""
        raise NotImplementedError

    def buffers(self, theta) -> dict:
        """The run state's momentum buffers for the weights `theta`: fp32 zeros, or none."""
        if not self.momentum:
            return {}
        import torch

        return {n: torch.zeros_like(t, dtype=torch.float32) for n, t in theta.items()}


class Nesterov(OuterOptimizer):
    """The built-in step (`optim.outer_steps.outer_step`): SGD with (Nesterov) momentum on the mean
    pseudo-gradient, outer.momentum and outer.nesterov; its state is the momentum, 4 bytes a parameter."""

    name, momentum = "nesterov", True

    def state_bytes(self, outer: OuterConfig) -> float:
        return FLOAT_BYTES

    def build(self, outer: OuterConfig, theta, momentum, replicas: int):
        from hypertrain.optim.outer_steps import NesterovStep

        return NesterovStep(outer, theta, momentum)


class DelayedNesterov(OuterOptimizer):
    """The asynchronous server's delayed Nesterov (Liu et al. 2024, Algorithm 3; docs/async.md): the
    built-in's momentum, updated once per outer.arrivals.dn_buffer arrivals from a buffer of them, 8 bytes a
    parameter (the momentum and the buffer). Picked by outer.arrivals.rule, never by outer.optimizer."""

    name, field, momentum = "delayed_nesterov", "outer.arrivals.rule", True

    def check(self, outer: OuterConfig) -> None:
        if named(outer.optimizer) is not NESTEROV:
            raise UserError(
                f"outer.arrivals.rule=delayed_nesterov with outer.optimizer={outer.optimizer}: delayed "
                "Nesterov is its own step on the built-in's momentum; valid: outer.arrivals.rule=naive (the "
                "optimizer's step on each server update's mean), or outer.optimizer=nesterov"
            )
        super().check(outer)

    def state_bytes(self, outer: OuterConfig) -> float:
        return 2 * FLOAT_BYTES

    def build(self, outer: OuterConfig, theta, momentum, replicas: int):
        from hypertrain.optim.outer_steps import DelayedNesterovStep

        return DelayedNesterovStep(outer, theta, momentum, replicas)


class TorchOptimizer(OuterOptimizer):
    """A torch.optim.Optimizer subclass named by its import path (`name`), built with lr=outer.lr and
    outer.optimizer_args; the pseudo-gradient is its parameters' `.grad`. Its state is its own
    `state_dict()`; its bytes per parameter are measured (`measured_bytes`)."""

    def __init__(self, name: str, cls):
        self.name, self.cls = name, cls

    def check(self, outer: OuterConfig) -> None:
        self.state_bytes(outer)

    def state_bytes(self, outer: OuterConfig) -> float:
        return measured_bytes(self, outer.lr, json.dumps(outer.optimizer_args, sort_keys=True))

    def build(self, outer: OuterConfig, theta, momentum, replicas: int):
        from hypertrain.optim.outer_steps import TorchStep

        return TorchStep(self.cls, outer.lr, dict(outer.optimizer_args), theta)


NESTEROV, DELAYED_NESTEROV = Nesterov(), DelayedNesterov()
TABLE = {entry.name: entry for entry in (NESTEROV, DELAYED_NESTEROV)}


def outer_optimizer(outer: OuterConfig) -> OuterOptimizer:
    """The run's outer optimizer: under outer.schedule=async an outer.arrivals.rule entry (delayed_nesterov)
    when there is one, else the one outer.optimizer names; UserError (one line) for a name that is none."""
    rule = TABLE.get(outer.arrivals.rule) if schedule_entry(outer.schedule).server else None
    return rule or named(outer.optimizer)


def check(outer: OuterConfig) -> None:
    """The run's outer optimizer checks `outer` (UserError, one line, before anything is made)."""
    outer_optimizer(outer).check(outer)


def named(name: str) -> OuterOptimizer:
    """The entry outer.optimizer=`name` picks: a built-in by its name, or a torch optimizer by its import
    path (whose state is its own `state_dict()`)."""
    if is_import_path(name):
        return torch_optimizer(name)
    entry = TABLE.get(name)
    if entry is None:
        raise UserError(f"outer.optimizer={name!r} is not an outer optimizer; valid: {NAMED}")
    if entry.field != "outer.optimizer":
        raise UserError(
            f"outer.optimizer={name!r} is a rule of asynchronous replicas, picked by {entry.field}={name}; "
            f"valid: {NAMED}"
        )
    return entry


def _line(error: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(error).split()) or type(error).__name__


@functools.cache
def torch_optimizer(path: str) -> TorchOptimizer:
    """The torch optimizer at the import path `path` (module.Class); UserError when the path does not
    import or names no torch.optim.Optimizer subclass."""
    module, _, attribute = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attribute)
    except Exception as error:  # a missing module or attribute, or a module that fails as it imports
        message = f"outer.optimizer={path!r} does not import ({_line(error)}); valid: {NAMED}"
        raise UserError(message) from None
    import torch

    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise UserError(f"outer.optimizer={path!r} names no torch.optim.Optimizer subclass; valid: {NAMED}")
    return TorchOptimizer(path, cls)


# Dummy parameters the state is measured on: two sizes, so that what an optimizer keeps per tensor (a
# step count) falls out of the difference and what it keeps per parameter remains
MEASURE_SIZES = (64, 192)


@functools.cache
def measured_bytes(entry: TorchOptimizer, lr: float, args_json: str) -> float:
    """The bytes `entry` keeps per parameter, measured: a copy built with `lr` and the arguments
    (`args_json`) steps once on a small dummy fp32 parameter of each of two sizes, and the tensors of its
    state are counted; the difference over the sizes' difference is its bytes per parameter. The run's
    random numbers are left as they were (torch's CPU generator saved and restored around it: an
    optimizer may draw). UserError (one line) for arguments it does not take, or a step it cannot make
    on a given gradient (one that needs a closure)."""
    import torch

    args = json.loads(args_json)
    given = "outer.optimizer_args=" + json.dumps(args, separators=(",", ":"))
    for key in ("lr", "params"):
        if key in args:
            raise UserError(
                f"{given} holds {key!r}, which the run gives: the learning rate is outer.lr, the parameters "
                f"the model's; valid: the keyword arguments of {entry.name} but params and lr"
            )
    counts = []
    with torch.random.fork_rng(devices=[]):
        for size in MEASURE_SIZES:
            p = torch.zeros(size)
            try:
                optimizer = entry.cls([p], lr=lr, **args)
            except Exception as error:
                raise UserError(
                    f"{given} is not taken by {entry.name} ({_line(error)}); valid: its keyword arguments "
                    "but params and lr"
                ) from None
            p.grad = torch.full_like(p, 1e-3)
            try:
                optimizer.step()
            except Exception as error:
                raise UserError(
                    f"outer.optimizer={entry.name} cannot step on a given gradient ({_line(error)}); valid: "
                    "an optimizer whose step() needs no closure"
                ) from None
            counts.append(
                sum(
                    t.numel() * t.element_size()
                    for kept in optimizer.state.values()
                    for t in kept.values()
                    if torch.is_tensor(t)
                )
            )
    return (counts[1] - counts[0]) / (MEASURE_SIZES[1] - MEASURE_SIZES[0])
