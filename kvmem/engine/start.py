"""The engine a configuration asks for: replicas over HTTP when `engine.url` is set, else vLLM
in this process. Imported lazily: neither choice imports vLLM until it is made."""

from __future__ import annotations

from kvmem.config import Config, ConfigError
from kvmem.engine.protocol import Engine
from kvmem.kv.store import KVStore
from kvmem.model import ModelInfo


def start_engine(config: Config, model: ModelInfo, blobs: KVStore) -> Engine:
    """`blobs`: the KV store as this process sees it (a RemoteEngine waits on its stamps)."""
    if config.engine.url or config.engine.members:  # replicas serve (kvmem replica); no vLLM in this process
        from kvmem.engine.membership import Registry
        from kvmem.engine.remote import RemoteEngine, Timeouts

        timeouts = Timeouts(config.engine.connect_timeout_s, config.engine.reply_timeout_s)
        members = Registry(config.database_url or "") if not config.engine.url else None  # a static list wins
        return RemoteEngine(config.engine.url or [], model, blobs, use_reader=config.kv.reader_adapter != "off",
                            timeouts=timeouts, members=members, residency=_residency(config, model))
    from kvmem.engine.llm import LocalEngine
    from kvmem.engine.replica import engine_kwargs

    engine_kwargs(config.engine.vllm_args)  # an unknown vLLM argument: a ConfigError now, not a failed start
    return LocalEngine(model, config)


def _residency(config: Config, model: ModelInfo):
    """The replicas' residency summaries, where engine.routing asks for them (they live in Redis)."""
    if config.engine.routing != "residency":
        return None
    if not config.kv.shared_url:
        raise ConfigError("engine.routing = \"residency\" needs kv.shared_url (--kv-shared-url, KVMEM_KV_SHARED_URL): "
                          "replicas publish what their RAM tier holds in that Redis")
    from kvmem.engine.residency import ResidencyView

    return ResidencyView(config.kv.shared_url, model.fingerprint)
