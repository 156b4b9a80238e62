"""The W&B settings a run starts with, checked before anything is written: the mode (WANDB_MODE wins over
logger.mode), the project name, and credentials for an online mode, each refusal one UserError line.
"""

from __future__ import annotations

import os
import sys

from hypertrain.config import LoggerConfig, UserError

# What wandb 0.31 accepts (`wandb.Settings.mode`; `run` and `shared` log online, `dryrun` offline) and
# its project-name rule (`Settings.validate_project`); tests/test_log.py holds them to wandb's own.
WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")


WANDB_LOCAL_MODES = ("offline", "dryrun", "disabled")  # need no credentials


PROJECT_MAX = 128


PROJECT_FORBIDDEN = "/\\#?%:"


def wandb_mode(logger_cfg: LoggerConfig) -> str:
    """The mode W&B runs in: the WANDB_MODE environment variable when set (wandb reads it, even
    empty), else `logger.mode`."""
    return os.environ["WANDB_MODE"] if "WANDB_MODE" in os.environ else logger_cfg.mode


def check_wandb(logger_cfg: LoggerConfig) -> None:
    """UserError (one line) when W&B could not start this run's W&B run, as far as that is known
    before anything is written: a mode wandb does not have, a project name it rejects, an online mode
    without credentials where wandb looks for them (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, the
    netrc for its host, its settings file: wandb's own lookup, which reads files, asks no server)."""
    if logger_cfg.name != "wandb":
        return
    mode = wandb_mode(logger_cfg)
    named = f"WANDB_MODE={mode!r}" if "WANDB_MODE" in os.environ else f"logger.mode={mode!r}"
    if mode not in WANDB_MODES:
        raise UserError(f"{named} is not a W&B mode; valid: {', '.join(WANDB_MODES)}")
    project = logger_cfg.project
    found = sorted({c for c in project if c in PROJECT_FORBIDDEN})
    if len(project) > PROJECT_MAX or found or not project.strip():
        why = f"{len(project)} characters" if len(project) > PROJECT_MAX else f"it holds {''.join(found)!r}"
        why = "it is empty" if not project.strip() else why
        raise UserError(
            f"logger.project={project!r} is not a W&B project name ({why}); valid: 1 to {PROJECT_MAX} "
            f"characters, none of {' '.join(PROJECT_FORBIDDEN)}"
        )
    if mode not in WANDB_LOCAL_MODES:
        _check_credentials(named)


def quiet_wandb() -> None:
    """Before wandb is set up: it reports no error home and prints no line of its own (its settings
    read these once; a run's failure is the entry's one line)."""
    os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    os.environ.setdefault("WANDB_SILENT", "true")


def _check_credentials(named: str) -> None:
    """An online mode needs credentials wandb finds without asking (the entry is no login prompt)."""
    quiet_wandb()
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib.wbauth import authenticate

    try:  # wandb's settings read the WANDB_* environment: a bad value there is wandb.init's failure too
        host = wandb_setup.singleton().settings.base_url
    except Exception as e:  # pydantic's ValidationError: several lines, the first names the setting
        said = " ".join(str(e).split())[:200]
        raise UserError(
            f"{named}: W&B's settings from the environment are not valid ({said}); valid: the WANDB_* "
            "variables as wandb documents them"
        ) from None
    try:
        found = authenticate.authenticate_session(
            host=host, source="hypertrain", prompt=False, update_session=False
        )
    except Exception as e:  # wandb.errors.AuthenticationError: a key of the wrong form
        raise UserError(
            f"{named}: W&B's credentials for {host} are not valid ({str(e).splitlines()[0]}); valid: "
            "`wandb login`, or logger.mode=offline"
        ) from None
    if found is None:
        raise UserError(
            f"{named} needs W&B credentials for {host}, and there are none (no WANDB_API_KEY, no netrc "
            "entry, no `wandb login`); valid: `wandb login` or WANDB_API_KEY=..., or logger.mode=offline "
            "(upload later with `wandb sync`)"
        )


def wandb_is_set_up() -> bool:
    """Whether W&B's process-wide singleton exists. It reads its settings (WANDB_BASE_URL,
    WANDB_INIT_TIMEOUT, ...) from the environment once, when it is made, and writes into the
    environment: one made by a call is torn down after it, so the next call reads its own environment
    (a singleton the caller made before is the caller's, and stays)."""
    setup = sys.modules.get("wandb.sdk.wandb_setup")
    return setup is not None and getattr(setup, "_singleton", None) is not None
