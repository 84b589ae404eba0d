"""The exceptions callers of kvmem see. Catch `KvmemError` to catch them all."""


class KvmemError(Exception):
    """Base class for every error kvmem raises on purpose."""


class ModelError(KvmemError):
    """The model could not be found, converted or loaded."""


class BlobError(KvmemError):
    """A fact's KV blob cannot be injected. `reason` is one of the REASONS below."""

    MISSING = "missing"
    CORRUPT = "corrupt"
    STALE = "stale"  # written for another model fingerprint or KV format version
    MISMATCH = "mismatch"  # its token ids are not the tokens the prompt holds there

    def __init__(self, fact_id: str, reason: str, detail: str = "") -> None:
        self.fact_id = fact_id
        self.reason = reason
        super().__init__(f"KV blob for fact {fact_id!r} is {reason}" + (f": {detail}" if detail else ""))


class UnknownFactError(KvmemError, KeyError):
    """A fact id that was never registered (or was deleted)."""

    def __init__(self, fact_id: str) -> None:
        self.fact_id = fact_id
        super().__init__(f"unknown fact id {fact_id!r}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class IndexFileError(KvmemError):
    """A saved vector index that cannot be read: missing, truncated, or not written by this version."""


class InvalidInputError(KvmemError, ValueError):
    """Input that kvmem refuses: empty text, bad mode, a prompt that cannot fit, ...

    Set where it is raised: `param`, the argument or request field at fault ("facts",
    "messages[2].content", ...; None when no single one is), and `code`, one of the CODES below.
    The HTTP server maps the code to a status (server/errors.py) and never reads the message, so
    rewording a message changes neither."""

    INVALID_VALUE = "invalid_value"  # 400: malformed or out of range
    FACT_TOO_LARGE = "fact_too_large"  # 413: a fact over memory.max_fact_tokens
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # 422: does not fit the model's context
    CODES = (INVALID_VALUE, FACT_TOO_LARGE, CONTEXT_LENGTH_EXCEEDED)

    def __init__(self, message: str, *, param: str | None = None, code: str = INVALID_VALUE) -> None:
        if code not in self.CODES:
            raise ValueError(f"unknown InvalidInputError code {code!r}")
        super().__init__(message)
        self.param, self.code = param, code

    def __reduce__(self):  # keeps param and code across processes (pickle passes args only)
        return _invalid_input, (str(self), self.param, self.code)


def _invalid_input(message: str, param: str | None, code: str) -> InvalidInputError:
    return InvalidInputError(message, param=param, code=code)


class StoreUnavailableError(KvmemError):
    """The facts database could not be reached, or refused a statement for lack of resources
    (disk full, too many connections). A write that raised it was rolled back, unless the
    connection was lost during COMMIT itself (outcome unknown: adding the same text again is a
    no-op, de-duplication makes the retry safe). The HTTP server answers 503 with Retry-After."""

    code = "store_unavailable"
    param = None
    RETRY_AFTER_S = 2  # what a caller is told to wait: a restart or failover takes seconds


class EngineError(KvmemError):
    """The inference engine failed to start or to answer."""


class UnsupportedConfigError(EngineError):
    """vLLM was configured in a way kvmem cannot serve yet (raised at start-up, with the reasons)."""


class RequestCancelled(KvmemError):
    """The caller cancelled a request before its answer (e.g. the HTTP client went away); the
    engine aborted it and freed its KV blocks."""


class AdapterError(KvmemError):
    """A reader adapter folder is missing, unreadable, or made for another model."""
