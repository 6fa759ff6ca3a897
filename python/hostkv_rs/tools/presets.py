"""Model geometries for the `hostkv-rs` demo and benchmarks (KV cache shape per rank, TP1), and
the device pools built from them.

Kept free of a top-level torch import so that `hostkv-rs --help` answers instantly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# --dtype names -> (torch attribute, element bytes). fp8 device pools store uint8 (SGLang's
# store_dtype), so their host pools are uint8 too.
DTYPES: dict[str, tuple[str, int]] = {
    "bf16": ("bfloat16", 2),
    "bfloat16": ("bfloat16", 2),
    "fp16": ("float16", 2),
    "float16": ("float16", 2),
    "fp32": ("float32", 4),
    "float32": ("float32", 4),
    "fp8": ("float8_e4m3fn", 1),
    "fp8_e4m3": ("float8_e4m3fn", 1),
    "fp8_e5m2": ("float8_e5m2", 1),
}


_MHA_FIELDS = ("layers", "heads", "head_dim", "v_head_dim")
_MLA_ONLY = ("kv_lora_rank", "qk_rope_head_dim")


@dataclass(frozen=True)
class Preset:
    name: str
    kind: str  # "mha" | "asym" | "mla"
    layers: int
    dtype: str
    # MHA / asymmetric MHA
    heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    # MLA
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    # The layout/backend SGLang would use by default for this kind of pool.
    layout: str = "layer_first"
    backend: str = "kernel"
    source: str = ""

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, _dtype_entry(self.dtype)[0])

    def plane_item_bytes(self) -> list[int]:
        """Bytes of one token of one layer in each host plane (K, V for MHA; latent for MLA)."""
        e = _dtype_entry(self.dtype)[1]
        if self.kind == "mla":
            return [(self.kv_lora_rank + self.qk_rope_head_dim) * e]
        return [self.heads * self.head_dim * e, self.heads * self.v_head_dim * e]

    def bytes_per_token(self) -> int:
        return sum(self.plane_item_bytes()) * self.layers

    def describe(self) -> str:
        if self.kind == "mla":
            return (
                f"MLA, {self.layers} layers, latent {self.kv_lora_rank} + rope "
                f"{self.qk_rope_head_dim}, {self.dtype}"
            )
        if self.head_dim == self.v_head_dim:
            return (
                f"MHA, {self.layers} layers, {self.heads} KV heads x {self.head_dim}, {self.dtype}"
            )
        return (
            f"MHA with asymmetric K/V, {self.layers} layers, {self.heads} KV heads x "
            f"K {self.head_dim} / V {self.v_head_dim}, {self.dtype}"
        )

    def with_overrides(self, **overrides) -> Preset:
        """Apply CLI overrides (None means keep); a new head_dim carries v_head_dim along for
        symmetric presets so `--head-dim 64` stays symmetric."""
        changes = {k: v for k, v in overrides.items() if v is not None}
        foreign = _MLA_ONLY if self.kind != "mla" else ("heads", "head_dim", "v_head_dim")
        for field in foreign:
            if field in changes:
                flag = field.replace("_", "-")
                raise ValueError(
                    f"--{flag} does not apply to the {self.kind.upper()} preset {self.name}"
                )
        if "dtype" in changes:
            _dtype_entry(changes["dtype"])
        if self.kind == "mha" and "head_dim" in changes and "v_head_dim" not in changes:
            changes["v_head_dim"] = changes["head_dim"]
        out = replace(self, **changes)
        if out.kind == "mha" and out.v_head_dim != out.head_dim:
            # a symmetric preset given a different V width becomes the asymmetric pool, as
            # get_mha_host_pool_cls would choose
            out = replace(out, kind="asym")
        if out.kind == "asym" and out.v_head_dim == out.head_dim:
            out = replace(out, kind="mha")
        fields = ("layers", "kv_lora_rank") if out.kind == "mla" else _MHA_FIELDS
        for field in fields:
            if getattr(out, field) <= 0:
                flag = field.replace("_", "-")
                raise ValueError(f"--{flag} must be positive, got {getattr(out, field)}")
        if out.kind == "mla" and out.qk_rope_head_dim < 0:
            raise ValueError(f"qk-rope-head-dim must be >= 0, got {out.qk_rope_head_dim}")
        return out


def _dtype_entry(name: str) -> tuple[str, int]:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="llama-3.1-8b",
            kind="mha",
            layers=32,
            heads=8,
            head_dim=128,
            v_head_dim=128,
            dtype="bf16",
            source="meta-llama/Llama-3.1-8B config.json: 32 layers, 8 KV heads, head_dim 128",
        ),
        Preset(
            name="deepseek-v3",
            kind="mla",
            layers=61,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            dtype="bf16",
            source="deepseek-ai/DeepSeek-V3 config.json: 61 layers, kv_lora_rank 512, "
            "qk_rope_head_dim 64",
        ),
        Preset(
            name="mimo-v2",
            kind="asym",
            layers=48,
            heads=4,
            head_dim=192,
            v_head_dim=128,
            dtype="bf16",
            # Asymmetric host pools support only these two layouts (kernel: page_first).
            layout="page_first",
            backend="kernel",
            source="XiaomiMiMo/MiMo-V2-Flash: 48 layers; full-attention layers have 4 KV heads, "
            "head_dim 192, v_head_dim 128 (SWA layers use 8 KV heads and live in a separate "
            "SWA pool in SGLang). Illustrative: all 48 layers in one pool of the full-attention "
            "geometry.",
        ),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None


def build_device_pool(preset: Preset, size: int, page_size: int, device: str):
    """The reference device pool for `preset`: `size` usable token slots plus SGLang's padding page
    (slot/page 0), so usable device pages are 1..size // page_size."""
    from hostkv_rs.tools.device_pools import MHATokenToKVPool, MLATokenToKVPool

    if preset.kind == "mla":
        return MLATokenToKVPool(
            size,
            page_size,
            preset.torch_dtype,
            preset.kv_lora_rank,
            preset.qk_rope_head_dim,
            preset.layers,
            device=device,
        )
    return MHATokenToKVPool(
        size,
        page_size,
        preset.torch_dtype,
        preset.heads,
        preset.head_dim,
        preset.layers,
        device=device,
        v_head_dim=preset.v_head_dim,
    )


def host_pool_class(device_pool, kind: str):
    """The host pool class SGLang would build for `device_pool` (MHA goes through the factory)."""
    if kind == "mla":
        from hostkv_rs.pools.mla import MLATokenToKVPoolHost

        return MLATokenToKVPoolHost
    from hostkv_rs.pools import mha

    factory = getattr(mha, "get_mha_host_pool_cls", None)
    if factory is not None:
        return factory(device_pool)
    if device_pool.head_dim != getattr(device_pool, "v_head_dim", device_pool.head_dim):
        return mha.AsymmetricMHATokenToKVPoolHost
    return mha.MHATokenToKVPoolHost
