"""Errors users can act on: they say which key or file is wrong and what was expected."""


class ConfigError(ValueError):
    """Bad configuration or input, detected before expensive work starts."""


class ReplayError(ValueError):
    """A replay/dump file that cannot be used (corrupt, unsafe, or from another model)."""


class CheckFailed(RuntimeError):
    """A precision check failed during a run with debug.strict_checks=true."""


class WeightSyncFailed(CheckFailed):
    """A weight sync did not land: an engine computes with other values than the trainer sent
    (the always-on check after every sync, relax/debug/sync_check.py); names the tensor."""


class NonFiniteError(RuntimeError):
    """A NaN or Inf where training needs finite numbers (a reward, a loss, a grad norm,
    weights about to be checkpointed); the message names the sample or file to look at."""


class DiskFull(OSError):
    """No space left for a file Relax must write (names the path and the space needed)."""


class EngineDied(RuntimeError):
    """A process of the inference engine (SGLang's scheduler or detokenizer) exited while the
    engine started: its own traceback is in the log above this error."""


class Interrupted(Exception):
    """The run stopped on SIGINT or SIGTERM after finishing a rollout (resume continues it)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class RolloutError(RuntimeError):
    """A user's rollout function failed (rollout.generate_fn, task.reward_fn, a remote reward,
    rollout.dynamic_sampling_filter) or returned what cannot be trained on; the message names
    the function, the sample and, for a raise, its traceback. Nothing was trained on that rollout."""


# raised in another process (a trainer rank, an engine's process, a Ray actor), these reach the
# driver as themselves, not as a traceback: the run ends with their message (exit 2)
USER_ERRORS = (ConfigError, ReplayError, CheckFailed, NonFiniteError, RolloutError, DiskFull)
