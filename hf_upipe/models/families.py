"""The registry's entries: what hf_upipe records of each transformers architecture, family by family.

Entry points:
- `Architecture`: one entry (its attention, MLP and norm classes; whether the fused attention adapter and the tiled
  MLP/norm adapter apply, and the attention's variant: fused qkv projection, norm over the whole projection, RoPE
  pairing; the transformers source they were verified against; whether it is verified exact under sequence
  parallelism, which the support gate requires).
- `FUSED`: the Llama-shaped families with the fused block; `VERIFIED_REGISTERED`: the others the matrix found exact
  on the registered path; `TEXT_ONLY`: multimodal types verified for text input only (`TEXT_MODEL_TYPES`: their
  language models' types); `VISION`: vision-language types verified with their images merged whole before the
  sequence is sharded (`hf_upipe.vlm`; `VISION_TEXT`: their language models' types); `ACROSS_DOCUMENTS`: verified
  types whose mask ignores packed rows' documents.

`hf_upipe.models.architectures` assembles these into the registry (`ARCHITECTURES`, keyed by `model_type`) and looks
entries up; add an architecture here.

Verified sources. An adapter replaces `forward` on transformers' module instances, so it is only right while it
computes what transformers' code for that module computes. Each architecture records, per adapter, the fingerprints
(SHA-256, 16 hex digits) of the source it replaces or relies on in each transformers release it was verified on
(`hf_upipe.models.verification.VERIFIED_RELEASES`): for the fused attention, the attention class's `__init__` and
`forward` and the module's `apply_rotary_pos_emb` / `rotate_half`; for the tiled MLP, the MLP's and RMSNorm's
`forward`. A fingerprint in the list is the fast path; a source not seen before is checked by behaviour on the
installed code before the adapter is installed (`hf_upipe.attention.fused.fused_verdict`,
`hf_upipe.adapters.tiled_mlp.tiled_verdict`); `hf_upipe.models.architectures.source_fingerprint` reads the installed
one.

This module is pure data: it imports nothing of hf_upipe and no third-party package.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ACROSS_DOCUMENTS",
    "FUSED",
    "TEXT_MODEL_TYPES",
    "TEXT_ONLY",
    "VERIFIED_REGISTERED",
    "VISION",
    "VISION_TEXT",
    "Architecture",
]


@dataclass(frozen=True)
class Architecture:
    """One transformers architecture.

    Attributes:
        model_type: `config.model_type`.
        prefix: class-name prefix in `transformers.models.<module>.modeling_<module>` (e.g. "Llama").
        fused: the fused attention adapter applies (projections, QK-norm and RoPE inside the head-chunk loop).
        tiled: the tiled MLP / norm adapter applies (per-token MLP and norm modules).
        window_in_config: the attention module does not carry its sliding window; read `config.sliding_window`.
        module: transformers' module name when it is not `model_type` (gemma3_text lives in `gemma3`).
        qkv_fused: one `qkv_proj` whose rows are q | k | v (Phi-3) instead of q_proj/k_proj/v_proj.
        projection_norm: q_norm/k_norm are RMSNorms over the whole projection (OLMo 2), not per head.
        rope_interleaved, rope_fp32: RoPE pairs (2i, 2i+1) and runs in fp32 (Cohere).
        mlp_suffix, norm_suffix: the tiled classes' suffixes (None: not tiled; MoE blocks are not).
        text_only: a multimodal type verified for text input only: under SP, `prepare_model`'s pre-hook refuses
            every other input (pixel values, audio features, cross-attention masks, ...).
        vision: a vision-language type verified with its images merged whole and the sequence sharded after
            (`hf_upipe.vlm.shard_multimodal_batch`): under SP, the pre-hook refuses pixel inputs passed to the
            forward itself.
        fused_fingerprints / tiled_fingerprints: the verified sources' fingerprints, one per release where the
            source differs (module docstring).
        verified: exact under sequence parallelism on the registered "upipe" path, as the architecture matrix
            (`benchmarks/architecture_matrix.py`) measured it; the support gate admits only verified types.
        packed_documents: the model passes position_ids to its mask builder, so on one device the documents of a
            packed row attend only within themselves; False (OPT, AFMoE): they attend across documents, and under
            SP too (`hf_upipe.attention.layout.validate_layout`).
    """

    model_type: str
    prefix: str = ""
    fused: bool = True
    tiled: bool = True
    window_in_config: bool = False
    fused_fingerprints: tuple[str, ...] = ()
    tiled_fingerprints: tuple[str, ...] = ()
    verified: bool = True
    text_only: bool = False
    vision: bool = False
    module: str = ""
    qkv_fused: bool = False
    projection_norm: bool = False
    rope_interleaved: bool = False
    rope_fp32: bool = False
    mlp_suffix: str | None = "MLP"
    norm_suffix: str | None = "RMSNorm"
    packed_documents: bool = True

    @property
    def attention(self) -> str:
        return f"{self.prefix}Attention"

    @property
    def mlp(self) -> str | None:
        return f"{self.prefix}{self.mlp_suffix}" if self.mlp_suffix else None

    @property
    def norm(self) -> str | None:
        return f"{self.prefix}{self.norm_suffix}" if self.norm_suffix else None

    def fused_sources(self) -> tuple[str, ...]:
        extra = (
            (f"{self.prefix}RMSNorm.forward",) if self.projection_norm else ()
        )  # its math is re-implemented
        return (
            f"{self.attention}.__init__",
            f"{self.attention}.forward",
            "apply_rotary_pos_emb",
            "rotate_half",
            *extra,
        )

    def tiled_sources(self) -> tuple[str, ...]:
        return tuple(f"{name}.forward" for name in (self.mlp, self.norm) if name)


# the tiled MLP/norms' sources (the same in 5.23, 5.24 and 5.25)
_TILED = (
    "9dbbf389e9bdd646",
)  # LlamaMLP/RMSNorm-shaped forwards (identical source in several families)
_MOE_NORM = (
    "790fa612e4fa57ac",
)  # a Llama RMSNorm alone (the MoE families, whose MoE blocks are not tiled)
# exact at SP 2 against one process on the registered "upipe" path in the architecture matrix
# (benchmarks/architecture_matrix.py, transformers 5.23; text-only causal LMs: a multimodal type stays unverified
# even where its text model is exact): verified, without the fused or tiled adapters
VERIFIED_REGISTERED = (
    "apertus",
    "arcee",
    "aria_text",
    "beam",
    "bitnet",
    "cohere2",
    "cohere2_moe",
    "cwm",
    "diffllama",
    "dots1",
    "ernie4_5",
    "ernie4_5_moe",
    "exaone4",
    "exaone_moe",
    "flex_olmo",
    "gemma4_unified_text",
    "glm",
    "glm4",
    "glm4_moe",
    "gpt-sw3",
    "gpt2",
    "gpt_bigcode",
    "gpt_neox",
    "granitemoeshared",
    "helium",
    "hrm_text",
    "hunyuan_v1_dense",
    "hunyuan_v1_moe",
    "hy_v3",
    "hyperclovax",
    "internlm3",
    "iquestcoder",
    "jais2",
    "jetmoe",
    "kolibri1",
    "laguna",
    "lfm2",
    "mellum",
    "minimax_m2",
    "minimax_m3_vl_text",
    "ministral",
    "ministral3",
    "modernbert-decoder",
    "moshi",
    "nanochat",
    "olmo",
    "olmo3",
    "olmoe",
    "persimmon",
    "phi",
    "phimoe",
    "seed_oss",
    "solar_open",
    "starcoder2",
    # multi-head latent attention (value heads of another width, padded in `upipe_attention_forward`)
    "axk1",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe_lite",
    "longcat_flash",
    "minicpm3",
    "youtu",
    # attention sinks (`s_aux`, from the log-sum-exp in `upipe_attention`; gpt_oss in ACROSS_DOCUMENTS)
    "flint",
    "mimo_v2_flash",
    # attention-logit soft-capping (`hf_upipe.ops.softcap`)
    "gemma2",
    "vaultgemma",
    # its decoder layers drop the attention kwargs: packed rows' documents come from the model call
    "nemotron",
    # Granite with sliding windows
    "granite_swa",
    "granitemoe_swa",
    # chunked attention (`hf_upipe.attention.mask`)
    "llama4_text",
    # hybrids whose gated-DeltaNet, Mamba2 or short-convolution layers run across shards
    # (`hf_upipe.adapters.mixers`; lfm2 above)
    "bailing_hybrid",
    "olmo_hybrid",
    "qwen3_5_moe_text",
    "qwen3_5_text",
    "qwen3_next",
    "bamba",
    "falcon_h1",
    "granitemoehybrid",
    "nemotron_h",
    "zamba2",
    # Mamba2 alone (no attention layers): its mixers run across shards as the hybrids' do
    "mamba2",
    # a key bias (its gradient is zero in exact arithmetic: see `hf_upipe.tools.selftest.GRADIENT_FLOOR`)
    "ctrl",
    # Emu3's language model (Emu3ForCausalLM; the multimodal "emu3" is in TEXT_ONLY)
    "emu3_text_model",
    # DBRX (a fused qkv projection clamped by clip_qkv); Gemma 3n's language model (AltUp, per-layer inputs, KV
    # sharing); Gemma 4's (per-layer inputs; its KV sharing is refused by the support gate)
    "dbrx",
    "gemma3n_text",
    "gemma4_text",
    # LFM2-MoE: its short convolutions run across shards as LFM2's do
    "lfm2_moe",
    # types that transformers 5.23 does not have, verified on 5.24 alone
    "apertus1p5_text",
    "exaone",
    "sarvam_mla",
    "sarvam_moe",
    # types that transformers 5.23 and 5.24 do not have, verified on 5.25 (the architecture matrix's checks, opted in)
    "minicpm5_moe",
    "param2moe",
    # on 5.24 through transformers' attention interface; 5.23's attention bypasses it (`model_refusal` refuses them)
    "codegen",
    "gptj",
)
# the Llama-shaped families with the fused block (each also exact on the registered path); MoE blocks stay untiled
# (their norms are tiled), and Cohere's LayerNorm is tiled as its norm
# the fused attention's sources, per release verified (transformers 5.23, 5.24, 5.25; one entry per release whose
# source differs): model_type -> fingerprints
_FUSED_SOURCES = {
    "llama": ("a0d395fa0cfcaa0f", "e406be0e59883e41", "b156fcdac60adb4f"),
    "mistral": ("c3b3be99e77bcec1", "7432c7942a55b5ba", "a7f858c7c614fba0"),
    "qwen2": ("216c98ededbca3e0", "185b09d011ac802e", "5dc361b20bdb2b04"),
    "qwen3": ("643897dbf1d482cc", "99d7bba274ac9eee", "fb2c46ca37e9b5b5"),
    "mixtral": ("cb82e38bed550d12", "4544bcbc67f076ef", "a7f858c7c614fba0"),
    "qwen2_moe": ("37b9e77e49266ba0", "0352bcd5506560a0", "b156fcdac60adb4f"),
    "qwen3_moe": ("f33c3236244793f8", "482c10611ff6bccb", "fb2c46ca37e9b5b5"),
    "granite": ("ff085b6eb9e7e7ef", "72de6fadb3856231", "b156fcdac60adb4f"),
    "granitemoe": ("fc6bc1fb65339952", "534b92efeee132cf", "b156fcdac60adb4f"),
    "olmo2": ("11921dce07f14631", "47d18e679604ff43", "31b6b41160e84a39"),
    "phi3": ("fdb27daee609b944", "cbdaa4bca0f9a4d8"),
    "gemma": ("915c1d81e23d9cdc", "3b2dc74f2a118b57", "b156fcdac60adb4f"),
    "gemma3_text": ("ae094d89156cbb5c", "744d4fc6eefde09a", "8581a70c2b42ef91"),
    "smollm3": ("9464eeefa2833c5a", "ef344d37c146d4d9", "16877a2470ec48c0"),
    "cohere": ("e861038c284bdaa7", "ce7aa900fc92e443"),
}


def _fused(model_type: str, prefix: str, tiled: tuple[str, ...] = _TILED, **kw) -> Architecture:
    return Architecture(
        model_type,
        prefix,
        fused_fingerprints=_FUSED_SOURCES[model_type],
        tiled_fingerprints=tiled,
        **kw,
    )


FUSED = (
    _fused("llama", "Llama"),
    _fused("mistral", "Mistral", window_in_config=True),
    _fused("qwen2", "Qwen2"),
    _fused("qwen3", "Qwen3"),
    _fused("mixtral", "Mixtral", _MOE_NORM, window_in_config=True, mlp_suffix=None),
    _fused("qwen2_moe", "Qwen2Moe", _MOE_NORM, mlp_suffix=None),
    _fused("qwen3_moe", "Qwen3Moe", _MOE_NORM, mlp_suffix=None),
    _fused("granite", "Granite"),
    _fused("granitemoe", "GraniteMoe", _MOE_NORM, mlp_suffix=None),
    _fused("olmo2", "Olmo2", ("ef3cf012f30786e0", "64806233e999a0db"), projection_norm=True),
    _fused("phi3", "Phi3", ("1a3f6cee1e1be859",), window_in_config=True, qkv_fused=True),
    _fused("gemma", "Gemma", ("905bb4e12a414935",)),
    _fused("gemma3_text", "Gemma3", ("6e5a6611dff1b85d",), module="gemma3"),
    _fused("smollm3", "SmolLM3"),
    _fused(
        "cohere",
        "Cohere",
        ("360e241039e06907",),
        rope_interleaved=True,
        rope_fp32=True,
        norm_suffix="LayerNorm",
    ),
)
# multimodal types whose language model is exact at SP 2 on text (the matrix's checks): verified for text input only.
# Each one's text config is a verified type too (the mask function's gate sees that config). Mllama's language
# model (MllamaForCausalLM) is text-only itself: its cross-attention layers are skipped without
# `cross_attention_states`, which the pre-hook refuses under SP.
TEXT_ONLY = (
    "emu3",
    "fuyu",
    "gemma3",
    "gemma4",
    "gemma4_unified",
    "got_ocr2",
    "llama4",
    "mllama",
    "mllama_text_model",
    "qwen3_5",
    "qwen3_5_moe",
)
# vision-language types exact at SP 2 with images merged whole and the sequence sharded after
# (`hf_upipe.vlm`, tests/integrations/test_vlm.py), and their language models' text configs
VISION = ("qwen2_vl", "qwen2_5_vl")
VISION_TEXT = ("qwen2_vl_text", "qwen2_5_vl_text")
# each of them -> the model_type of its text config (its language model: the path it runs under SP)
TEXT_MODEL_TYPES = {
    "emu3": "emu3_text_model",
    "fuyu": "persimmon",
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "gemma4_unified": "gemma4_unified_text",
    "got_ocr2": "qwen2",
    "llama4": "llama4_text",
    "mllama": "mllama_text_model",
    "mllama_text_model": "mllama_text_model",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
}
# verified types whose mask is built without position_ids: a packed row is one sequence on one device, and under SP
ACROSS_DOCUMENTS = ("afmoe", "gpt_oss", "opt")
