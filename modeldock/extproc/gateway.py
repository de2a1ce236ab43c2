"""The ext_proc service's domain state: keys, models, endpoints, freshness.

Plain Python, no gRPC. `RequestFlow` asks it questions; the ADS client feeds it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from modeldock.admission.keys import KeyStore
from modeldock.admission.limits import Admission
from modeldock.clock import Clock
from modeldock.config import Config, ModelConfig, TenantConfig
from modeldock.types import Endpoint
from modeldock.errors import Forbidden, NotFound, Unavailable
from modeldock.picking import Pick, Picker


class Gateway:
    def __init__(
        self,
        config: Config,
        clock: Clock,
        picker: Picker,
        admission: Admission,
        *,
        xds_down_for: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.clock = clock
        self.picker = picker
        self.admission = admission
        self._xds_down_for = xds_down_for
        self.stale_models: frozenset[str] = frozenset()
        self.apply_config(config)

    def apply_config(self, config: Config) -> None:
        """Swap tenants, models and limits; used at start and on reload."""
        if getattr(self, "config", None) is not None:
            self.admission.reconfigure(config)
        self.config = config
        self.keys = KeyStore(config.tenants)
        self._models = {m.name: m for m in config.models}
        self.stale_after = config.discovery.stale_after_seconds
        self.max_body_bytes = config.limits.max_body_bytes

    # Fed by the ADS client.
    def on_endpoints(self, model: str, endpoints: tuple[Endpoint, ...]) -> None:
        config = self._models.get(model)
        # vLLM labels its metrics with the name it serves, which an alias may hide.
        self.picker.set_endpoints(model, endpoints, served_name=config.upstream_name if config else None)

    def on_status(self, stale_models: frozenset[str]) -> None:
        self.stale_models = stale_models

    def authenticate(self, key: str) -> TenantConfig:
        return self.keys.authenticate(key)

    def resolve_model(self, tenant: TenantConfig, name: str) -> ModelConfig:
        model = self._models.get(name)
        if model is None:
            raise NotFound(f"The model `{name}` does not exist.")
        if not tenant.allows(name):
            raise Forbidden(f"Your API key may not use the model `{name}`.")
        return model

    def visible_models(self, tenant: TenantConfig) -> list[str]:
        return [name for name in self._models if tenant.allows(name)]

    def check_dispatchable(self, model: str) -> None:
        """Raise 503 if no pick could succeed now: asked before admission, so a request
        that cannot be served does not use up the tenant's rate limit."""
        if model in self.stale_models or self._xds_down_for() > self.stale_after:
            raise Unavailable(
                f"The endpoint snapshot for model `{model}` is stale: discovery has not confirmed it "
                f"for over {self.stale_after:g}s, so the gateway is not dispatching. Retry shortly.",
                code="endpoint_snapshot_stale",
            )
        self.picker.require_endpoints(model)

    def pick(self, model: str, prefix: Sequence[int] = ()) -> Pick:
        """Check freshness, then choose and count in one synchronous step."""
        self.check_dispatchable(model)
        return self.picker.pick(model, prefix)
