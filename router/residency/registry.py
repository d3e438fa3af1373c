"""The model registry: what ray-config.yaml lists, turned into the policy's ModelSpecs and the
engines' manifest entries. A model's memory figures come from the config when given, else from
its folder (deployments.estimate), so admission works before anything is loaded."""

from pathlib import Path

from pydantic import ByteSize, Field, ValidationError, ValidationInfo, field_validator

from deployments.engines.options import LLMEngineOptions
from deployments.estimate import dtype_bytes, estimate, kv_bytes_quantized
from deployments.manifest import ManifestEntry, read_manifest
from deployments.tool_family import folder_template, infer_folder_family, infer_reasoning
from deployments.wire.measured import CacheShape
from policy import ModelSpec
from policy._frozen import Frozen
from policy.specs import ModelKind

SPEC_FIELDS = set(ModelSpec.model_fields) - {"name", "kind", "weight_bytes", "kv_bytes_per_token"}


class RegistryModel(Frozen):
    """One `models:` entry: a name, a kind, a folder (absolute, or relative to models_dir; on a Mac
    a Hugging Face repo id also works with the same loaders), optional sizes, and any ModelSpec
    field (role, pinned, keep_warm, idle_ttl_s, constraints, copies, KV reservation)."""

    # ASCII, no spaces or '@' (actor names are "<model>@<node>"): a name is a URL path segment too.
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/+-]*$", max_length=200)
    kind: ModelKind
    path: str | None = None  # default: the name, under models_dir
    hub_id: str | None = None  # e.g. mlx-community/Qwen2.5-7B-Instruct-4bit: loaded by id (give weight_bytes)
    weight_bytes: ByteSize | None = None
    kv_bytes_per_token: ByteSize | None = None
    # Output parsing (docs/tools-and-reasoning.md, docs/tool-calls.md). Not given: inferred from the
    # folder's chat template (`tool_family`); text models without a chat template of their own for
    # tools get Hermes-style tool prompts from the engine, so "hermes" is the fallback.
    tool_parser: str | None = "hermes"
    reasoning: bool | dict | None = None
    # This model's own LLM scheduling (deployments/engines/options.py), over the app's llm_engine:
    # e.g. {admit_hold_steps: 0} for a chat model whose first tokens matter more than tokens/s.
    llm_engine: dict | None = None
    policy: dict = Field(default_factory=dict)

    @field_validator("tool_parser")
    @classmethod
    def _text_models_only(cls, v: str | None, info: ValidationInfo) -> str | None:
        return v if info.data.get("kind") == "llm" else None  # only text models call tools

    @field_validator("llm_engine")
    @classmethod
    def _scheduling(cls, v: dict | None, info: ValidationInfo) -> dict | None:
        if v is None:
            return None
        if info.data.get("kind") != "llm":
            raise ValueError("llm_engine schedules text models (kind llm) only")
        try:
            return LLMEngineOptions.model_validate(v).model_dump(exclude_unset=True)  # only what it sets
        except ValidationError as e:
            first = e.errors()[0]
            raise ValueError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None


def parse_entries(models: list[dict]) -> list[RegistryModel]:
    """Every `models:` entry validated, ModelSpec fields included (they may sit at the top level of
    an entry or under `policy:`); a ValueError names the entry and the field. Reads no files: the
    app builder runs it before anything is deployed."""
    parsed: list[RegistryModel] = []
    for i, raw in enumerate(models):
        where = f"models[{i}]" + (f" ({raw.get('name')})" if isinstance(raw, dict) and raw.get("name") else "")
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected a mapping, got {type(raw).__name__}")
        raw = dict(raw)
        policy = {k: raw.pop(k) for k in list(raw) if k in SPEC_FIELDS} | raw.pop("policy", {})
        try:
            model = RegistryModel(**raw, policy=policy)
            ModelSpec(name=model.name, kind=model.kind, weight_bytes=model.weight_bytes or 0, **model.policy)
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "entry"
            raise ValueError(f"{where}.{field}: {first['msg']}") from None
        except TypeError as e:
            raise ValueError(f"{where}: {e}") from None
        if any(m.name == model.name for m in parsed):
            raise ValueError(f"{where}: model {model.name!r} is listed twice")
        if model.hub_id and model.path:
            raise ValueError(f"{where}: give path or hub_id, not both")
        parsed.append(model)
    return parsed


def hub_folder(repo_id: str) -> str:
    """Where node stores keep a hub model: models--<org>--<name>, as the Hub's own cache names it."""
    return "models--" + repo_id.replace("/", "--")


def model_folder(model: RegistryModel, models_dir: Path) -> Path:
    """A registry model's folder: its path (absolute, or under models_dir), else its name under models_dir."""
    path = Path(model.path or "")
    return path if model.path and path.is_absolute() else models_dir / (model.path or model.name)


def draft_folder(name: str | None, models: list[RegistryModel], models_dir: Path) -> Path | None:
    """A draft model's folder (llm_engine's draft_model): a registry model's, or a folder."""
    if not name:
        return None
    listed = next((m for m in models if m.name == name and not m.hub_id), None)
    if listed is not None:
        return model_folder(listed, models_dir)
    return Path(name) if Path(name).is_absolute() else models_dir / name


def from_config(models: list[dict], models_dir: str | Path, llm_engine: dict | None = None) -> tuple[dict[str, ModelSpec], dict[str, ManifestEntry]]:
    """(catalog for policy/, manifest entries for the model servers). Sizes not given are measured
    from the model's folder. `llm_engine`: the app's LLM engine options, under each text model's
    own: a quantized KV cache (kv_bits) is reserved at its quantized size."""
    models_dir = Path(models_dir)
    catalog: dict[str, ModelSpec] = {}
    entries: dict[str, ManifestEntry] = {}
    parsed = parse_entries(models)
    for model in parsed:
        folder, absolute = model_folder(model, models_dir), bool(model.path) and Path(model.path or "").is_absolute()
        weight: int | None = model.weight_bytes
        kv: int | None = model.kv_bytes_per_token
        engine = LLMEngineOptions.model_validate((llm_engine or {}) | (model.llm_engine or {})) if model.kind == "llm" else LLMEngineOptions()
        bits, group = engine.kv_bits, engine.kv_group_size
        draft = draft_folder(engine.draft_model, parsed, models_dir) if engine.speculation == "draft" else None
        if draft is not None:  # the engine loads it by this path; its memory is the instance's (estimate's draft)
            if not (draft / "config.json").is_file():
                raise ValueError(f"model {model.name}: no draft model at {draft}")
            model = model.model_copy(update={"llm_engine": (model.llm_engine or {}) | {"draft_model": str(draft)}})
        if kv is not None and bits is not None:  # a given figure is the unquantized cache's (as a manifest's)
            kv = kv_bytes_quantized(kv, dtype_bytes(folder) if not model.hub_id and folder.is_dir() else 2, bits, group)
        layers: dict[str, int] = {}  # M1: sliding windows and fixed-size state, from the folder when its KV is not given
        if (weight is None or kv is None) and not model.hub_id and folder.is_dir():
            size = estimate(folder, model.kind, bits, group, draft)
            weight = size.weight_bytes if weight is None else weight
            if kv is None:
                kv, layers = size.kv_bytes_per_token, cache_fields(size.cache, engine.prefill_chunk_tokens)
        if weight is None:
            where = f"hub model {model.hub_id}" if model.hub_id else f"no folder at {folder} to measure"
            raise ValueError(f"model {model.name}: no weight_bytes given ({where})")
        catalog[model.name] = ModelSpec(
            name=model.name, kind=model.kind, weight_bytes=weight, kv_bytes_per_token=kv or 0, hub=model.hub_id is not None, **(layers | model.policy)
        )
        entries[model.name] = ManifestEntry(
            name=model.name,
            kind=model.kind,
            path=model.hub_id or str(folder),
            hub=model.hub_id is not None,
            folder=hub_folder(model.hub_id) if model.hub_id else None if absolute else Path(model.path or model.name).as_posix(),
            weight_bytes=int(weight),
            kv_bytes_per_token=int(kv or 0),
            weights="real",
            architecture="unknown",
            source=model.hub_id or str(folder),
            tool_parser=tool_family(model, folder),
            reasoning=reasoning_of(model, folder),
            llm_engine=model.llm_engine,
        )
    return catalog, entries


def cache_fields(cache: CacheShape, prefill_chunk: int) -> dict[str, int]:
    """The ModelSpec fields of a cache's sliding windows and fixed-size state (M1): a window holds
    up to W - 1 + a prefill chunk while it prefills."""
    fields = {"kv_state_bytes": cache.state_bytes} if cache.state_bytes else {}
    if cache.window_tokens:
        fields |= {"kv_window_bytes_per_token": cache.window_bytes_per_token, "kv_window_tokens": cache.window_tokens + prefill_chunk - 1}
    return fields


def tool_family(model: RegistryModel, folder: Path) -> str | None:
    """The entry's tool-call family: `tool_parser` when the entry gives it, else what the model
    folder's chat template (and vocabulary) says (deployments.tool_family), else "hermes"
    (a hub model, a template that names no family: the engine's Hermes-style tool prompt)."""
    if model.kind != "llm" or "tool_parser" in model.model_fields_set or model.hub_id or not folder.is_dir():
        return model.tool_parser
    return infer_folder_family(folder) or model.tool_parser


def reasoning_of(model: RegistryModel, folder: Path) -> bool | dict | None:
    """The entry's `reasoning` when it gives it, else the `<think>` blocks the folder's chat
    template writes (deployments.tool_family.infer_reasoning), else none."""
    if model.kind not in ("llm", "vlm") or "reasoning" in model.model_fields_set or model.hub_id or not folder.is_dir():
        return model.reasoning
    return infer_reasoning(folder_template(folder))


def from_manifest(models_dir: str | Path, overrides: dict[str, dict] | None = None) -> list[dict]:
    """Registry entries for every model of a prepared set (deployments.models), with per-model
    policy overrides (pinned, keep_warm, ...)."""
    overrides = overrides or {}
    return [
        {
            "name": e.name,
            "kind": e.kind,
            "path": e.path,
            "weight_bytes": e.weight_bytes,
            "kv_bytes_per_token": e.kv_bytes_per_token,
            **overrides.get(e.name, {}),
        }
        for e in read_manifest(models_dir).models
    ]
