"""What one call of the entry changes in its process, put back when it returns: `restored()` around
`hypertrain.train.cli`, so the entry can be called many times in one process (tests, a notebook) and
give the same records each time. A call's own state (the prepared run, its directory locks, the stop
signals it installed) lives in context variables, and `cli` runs each call in a fresh context.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hypertrain.failures.signals import STOP_SIGNALS
from hypertrain.rundir.wandb_settings import wandb_is_set_up


@contextmanager
def restored() -> Iterator[None]:
    """Run the body, then put back as they were: the environment, sys.argv, the working directory, the
    handlers of the stop signals, the root logger's and every existing logger's handlers and levels (a
    handler added meanwhile, Hydra's job log among them, is closed), Hydra's singletons (its config of
    the run, the job's runtime, `GlobalHydra` and its state) and, where torch is imported, torch's
    thread count, default random generator, deterministic-algorithm flags, matmul precision and default
    dtype; W&B set up by the call is torn down (`wandb_is_set_up`)."""
    environ, argv, cwd = dict(os.environ), list(sys.argv), os.getcwd()
    wandb_before = wandb_is_set_up()
    handlers = _signal_handlers()
    loggers = _loggers()
    hydra = _hydra_singletons()
    torch_state = _torch_state()
    try:
        yield
    finally:
        if not wandb_before and wandb_is_set_up():
            import wandb

            wandb.teardown()
        _restore_torch(torch_state)
        _restore_hydra(hydra)
        _restore_loggers(loggers)
        for signum, handler in handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
        os.chdir(cwd)
        sys.argv[:] = argv
        if dict(os.environ) != environ:
            os.environ.clear()
            os.environ.update(environ)


def _signal_handlers() -> dict[int, object]:
    try:
        return {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    except ValueError:  # not the main thread: the entry installs none there either
        return {}


def _loggers() -> dict[str, tuple]:
    """Every logger's (level, handlers, propagate, disabled), the root's under ''."""
    found = {"": logging.getLogger()}
    found |= {n: lg for n, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    return {name: (lg.level, list(lg.handlers), lg.propagate, lg.disabled) for name, lg in found.items()}


def _restore_loggers(saved: dict[str, tuple]) -> None:
    kept = {id(h) for _, handlers, _, _ in saved.values() for h in handlers}
    now = {"": logging.getLogger()}
    now |= {n: lg for n, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    for name, logger in now.items():
        for handler in list(logger.handlers):
            if id(handler) not in kept:  # added by this call (Hydra's console and file handlers)
                logger.removeHandler(handler)
                handler.close()
        if name in saved:
            level, handlers, propagate, disabled = saved[name]
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate, logger.disabled = propagate, disabled


def _hydra_singletons() -> tuple[dict, Any]:
    """Hydra's singletons, and the state of `GlobalHydra` where one was made before the call (a compose
    elsewhere): a refusal inside Hydra's app leaves that one initialized, and the next call refused."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.singleton import Singleton

    global_hydra = Singleton._instances.get(GlobalHydra)
    return dict(Singleton._instances), None if global_hydra is None else global_hydra.hydra


def _restore_hydra(saved: tuple[dict, Any]) -> None:
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.singleton import Singleton

    instances, global_hydra = saved
    before = instances.get(HydraConfig)
    config = None if before is None else before.cfg
    Singleton._instances.clear()
    Singleton._instances.update(instances)
    if GlobalHydra in instances:
        instances[GlobalHydra].hydra = global_hydra
    if before is not None:
        before.cfg = config


def _torch_state() -> dict | None:
    """torch's process-wide settings a run may change, when torch is imported (else there are none:
    a call that imports torch leaves it as torch starts, but for the thread count, which the entry
    sets and puts back around the run itself)."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "get_num_threads"):
        return None
    return {
        "threads": torch.get_num_threads(),
        "rng": torch.random.get_rng_state(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "matmul": torch.get_float32_matmul_precision(),
        "dtype": torch.get_default_dtype(),
    }


def _restore_torch(saved: dict | None) -> None:
    if saved is None:
        return
    import torch

    if torch.get_num_threads() != saved["threads"]:
        torch.set_num_threads(saved["threads"])
    torch.random.set_rng_state(saved["rng"])
    deterministic = (saved["deterministic"], saved["warn_only"])
    if deterministic != (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    ):  # only when changed: torch's setter imports torch._inductor, and with it torch._dynamo
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
    torch.set_float32_matmul_precision(saved["matmul"])
    torch.set_default_dtype(saved["dtype"])
