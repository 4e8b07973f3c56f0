"""Every error a user can meet, in one place: each names what the user can change."""


class TwophaseError(Exception):
    """Base class: a user-facing error with a message meant to be read, not a traceback."""


class ConfigError(TwophaseError):
    """A bad configuration: the message names the key path and what is allowed."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


class BackendUnavailable(TwophaseError):
    """A backend cannot run here (missing package, no device); the message says why."""


class RequestRejected(TwophaseError):
    """A request that can never be served (too long for the model or the KV pool, a grammar
    that does not compile); ``param`` names the request's field at fault where one is."""

    param: str | None = None


class ModelError(TwophaseError):
    """A model that cannot be found, fetched, converted or does not fit in memory."""


class InvalidSamplingParam(TwophaseError, ValueError):
    """A ``SamplingParams`` value out of range; ``name`` is the parameter."""

    def __init__(self, name: str, message: str):
        self.name = name
        self.message = message
        super().__init__(f"SamplingParams.{name} {message}")


class StepFailed(TwophaseError):
    """An engine step raised; the requests it computed (``request_ids``) were ended with
    ``finish_reason = "error"`` and their blocks freed. The cause is chained. ``had_running``:
    some of them had computed earlier steps (a failure of new prompts alone may be theirs)."""

    def __init__(self, message: str, request_ids: list[str], had_running: bool = True):
        self.request_ids = list(request_ids)
        self.had_running = had_running
        super().__init__(message)


def install_hint(extra: str) -> str:
    """The command that installs an optional part: twophase installs from its checkout (it is not
    on PyPI, so ``pip install 'twophase[extra]'`` finds nothing)."""
    return f"pip install -e '.[{extra}]' in the twophase checkout"
