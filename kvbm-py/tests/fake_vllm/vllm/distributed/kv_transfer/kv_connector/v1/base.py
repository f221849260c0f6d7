"""The shape of vLLM's KVConnectorBase_V1 as kvbm uses it (tests only), after vLLM 0.33's
vllm/distributed/kv_transfer/kv_connector/v1/base.py: the defaults kvbm relies on
(``handle_preemptions`` does nothing; ``get_required_kvcache_layout`` refuses the base class
and returns None for a subclass that does not override it)."""

import enum


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    pass


class KVConnectorWorkerMetadata:
    def aggregate(self, other):
        raise NotImplementedError


class KVConnectorBase_V1:
    def __init__(self, vllm_config, role, kv_cache_config=None):
        self._vllm_config = vllm_config
        self._role = role
        self._connector_metadata = None

    def bind_connector_metadata(self, connector_metadata):
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self):
        self._connector_metadata = None

    def handle_preemptions(self, kv_connector_metadata):
        return

    def build_connector_worker_meta(self):
        return None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config):
        if cls is KVConnectorBase_V1:
            raise TypeError("get_required_kvcache_layout should not be called on the abstract base class")
        return None
