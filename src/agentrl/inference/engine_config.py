"""Configuration of the inference engine: what it serves and how (:class:`EngineConfig`), where it listens and
whom it tells (:class:`EngineServerConfig`), and every flag of `agentrl engine` (:class:`EngineCommandConfig`, whose
flags are generated from these models by :mod:`agentrl.config_flags`; SGLang's names with underscores).

This module imports no torch, so building the command-line parser stays fast.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from agentrl.config_flags import Flag


class EngineServing(BaseModel):
    """How the engine serves a model: precision, KV cache, batching, decode graphs, LoRA, weight updates."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str | None = Field(None, description="model name reported to clients (default: the model "
                                          "directory's name)")
    device: str | None = Field(None, description="cpu, cuda, cuda:N (default: cuda if available, else cpu)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights dtype (auto: bfloat16 on CUDA GPUs with bf16 support; on a CPU with bf16 matrix "
        "instructions float32 weights whose layers but the LM head multiply in bf16; float32 elsewhere)")
    weight_version: str = Field("0", description="version reported for the initial weights")
    preferred_sampling_params: Annotated[dict[str, Any] | None, Flag(metavar="JSON")] = Field(
        None, description="the server's values of sampling parameters a /generate request omits, as SGLang's "
        "--preferred-sampling-params, e.g. '{\"temperature\": 0.6, \"top_p\": 0.95}' (default: SGLang's defaults: "
        "temperature 1, top_p 1, top_k -1, min_p 0, no penalties). presence_penalty/frequency_penalty subtract "
        "from the logits of generated tokens; the returned logprobs then include them, which a trainer cannot "
        "reproduce")
    max_total_tokens: int = Field(32768, gt=0, description="KV cache capacity in tokens, all requests together")
    page_size: int = Field(32, ge=4, description="tokens per KV-cache page; prompts share cached pages of a common "
                           "prefix (the system prompt, earlier turns), so smaller pages share more")
    max_batch_tokens: int = Field(2048, gt=0, description="tokens per forward pass, i.e. the prefill chunk")
    max_running_requests: int = Field(64, gt=0, description="requests decoded together at most")
    disable_cuda_graph: bool = Field(
        False, description="on CUDA, run decode steps eagerly instead of replaying them as CUDA graphs captured once "
        "per batch size (SGLang's --disable-cuda-graph)")
    cuda_graph_max_bs: int = Field(64, gt=0, description="the largest decode batch run as a CUDA graph; larger ones "
                                   "run eagerly (SGLang's --cuda-graph-max-bs)")
    enable_lora: bool = Field(
        False, description="serve LoRA adapters loaded at run time with /load_lora_adapter; a /generate request "
        "names one in lora_path (SGLang's --enable-lora). Turns prefix sharing off")
    weight_update_timeout_s: float = Field(
        120.0, gt=0, description="how long joining a weight-update group (/init_weights_update_group), and each of "
        "its transfers, may take before it fails")
    weight_update_mode: Literal["in_place", "drain"] = Field(
        "in_place", description="in_place: new weights are swapped in between two decoding steps, running requests "
        "go on with them and each token keeps the version that sampled it (a response spanning two versions lists "
        "them in meta_info.weight_version_spans); drain: running requests finish on the old weights while new ones "
        "wait, as SGLang without /pause_generation")

    @field_validator("preferred_sampling_params")
    @classmethod
    def _valid_sampling(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            from agentrl.inference.protocol import SamplingParams
            from agentrl.inference.request_rules import check_supported

            check_supported(SamplingParams.model_validate(value))
        return value


class EngineConfig(EngineServing):
    """What the engine serves and how."""

    model_name_or_path: str


class EngineServerConfig(BaseModel):
    """Where the engine listens, whom it tells and whom it serves."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on (any other than a loopback address needs an "
                      "API key)")
    port: int = Field(30000, ge=0, le=65535, description="port to listen on, 0 for a free one")
    api_key: SecretStr | None = Field(
        None, description="every request but /health and /health_generate must carry 'Authorization: Bearer KEY' "
        "(SGLang's --api-key; default: $AGENTRL_INFERENCE_API_KEY, which the samplers, trainer and evaluations "
        "send; prefer the variable: a command line is visible to other users)")
    db_connection_string: Annotated[str | None, Flag(metavar="URI")] = Field(
        None, description="register the engine in this run database's InferenceService collection, heartbeat, mark "
        "it DOWN on exit (default: $AGENTRL_DB if set, else no registration)")
    advertise_url: str | None = Field(None, description="URL to register in the database (default: "
                                      "http://HOST:PORT)")
    heartbeat_interval_s: float = Field(5.0, gt=0, description="seconds between heartbeats to the database")


class EngineCommandConfig(BaseModel):
    """Every flag of `agentrl engine`."""

    model_config = ConfigDict(extra="forbid")

    model_name_or_path: str | None = Field(None, description="Hugging Face model directory (default: the embedded "
                                           "SmolLM2-135M-Instruct)")
    serving: EngineServing = Field(default_factory=EngineServing, title="serving")
    server: EngineServerConfig = Field(default_factory=EngineServerConfig, title="server and registration")
    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads (default: $OMP_NUM_THREADS if set, else one less than the CPUs "
        "this machine gives the engine, at least 1: a decode step's small operations wait for every thread of the "
        "team, and the server and its neighbours need a core)")
    no_register: bool = Field(False, description="do not register in the database even if $AGENTRL_DB is set")
