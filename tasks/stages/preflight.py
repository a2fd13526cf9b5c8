"""What the stages would refuse that needs only the config and the files it names, found before any stage runs.

One list of findings for `eagleops validate` (every stage) and for the flows' first step (the stages the run
selects), so that nothing a config says can fail a run after a server was started for it:
- the launch flags against SGLang's rules and the model folders readable here, the draft that
  `--speculative-draft-model-path` in deploy.extra_args names included (`tasks.hosts.launch.validate_launch`);
- prompt + answer lengths: bench.max_new_tokens against data.max_length (builtin prompts stay within the
  trained length) and against the served context (`--context-length` for SGLang, else the served model's
  max_position_embeddings) -- the benchmark stage refused these only after the deploy stage's server was up;
- the prompt files (bench.prompts, data.prompts with data.host local) and train.init_checkpoint exist here,
  prompt files as JSON lines.
The stages keep their exact checks where they need what only a run has (the tokenized prompts, the host's
files); these are the cheap bounds, read in well under a second. It lives in the stages wing, the lowest one
that reaches both the config and the launch rules of `tasks.hosts`, and imports no stage.
"""

from __future__ import annotations

import json
from pathlib import Path

from tasks.config.load import ConfigError, field_location
from tasks.config.schema import ExperimentConfig
from tasks.hosts.launch import Finding, read_model_config, validate_launch

# The stages a finding's field matters to; a field not listed matters to every run.
NEEDED_BY = {
    "deploy.": ("deploy_server", "run_benchmark"),
    "bench.": ("run_benchmark",),
    "data.prompts": ("generate_data",),
    "train.init_checkpoint": ("train_draft",),
}
PROMPT_FILE_CHECKED_BYTES = 8 * 2**20  # a 100K-prompt file's first 8 MiB: its format, not every line


def preflight_findings(cfg: ExperimentConfig, stages: list[str] | None = None) -> list[Finding]:
    """Every finding (error, warning, info) for the stages given (None: all), each naming its field."""
    findings = validate_launch(cfg) + target_findings(cfg) + bench_length_findings(cfg) + file_findings(cfg)
    if stages is None:
        return findings
    return [f for f in findings if _needed(f.field, stages)]


def refuse_before_stages(cfg: ExperimentConfig, config_path: str | Path, variant: int | None = None,
                         stages: list[str] | None = None) -> None:
    """The flows' first step: raise ConfigError with one `file:line: field: check: reason` line per error.

    Under deploy.preflight: warn, what SGLang would refuse or rewrite is left to the deploy stage, which logs
    it and launches anyway (the setting exists to reproduce such a failure)."""
    errors = [f for f in preflight_findings(cfg, stages) if f.level == "error"]
    if cfg.deploy.preflight == "warn":
        errors = [f for f in errors if f.check != "sglang_settings"]
    if errors:
        raise ConfigError([finding_line(config_path, variant, f) for f in errors])


def finding_line(config_path: str | Path, variant: int | None, finding: Finding, name: str | None = None) -> str:
    """`file:line: [variant: ]field: check: reason`, at the line that sets the finding's field."""
    where = field_location(config_path, finding.field, variant) if finding.field else str(config_path)
    about = "".join(f"{part}: " for part in (name, finding.field) if part)
    return f"{where}: {about}{finding.line()}"


def _needed(field: str, stages: list[str]) -> bool:
    needed_by = next((by for prefix, by in NEEDED_BY.items() if field.startswith(prefix)), None)
    return needed_by is None or any(stage in stages for stage in needed_by)


# ------------------------------------------------------------------ the target the data stage reads


def target_findings(cfg: ExperimentConfig) -> list[Finding]:
    """What the environment and data stages refuse about an HF target read on this machine: data.max_length past its
    context, data.draft_vocab_size past its vocabulary, and no shape to size the hidden states by when its
    config.json is not here (target.shape declares it)."""
    if cfg.target.kind != "hf" or cfg.data.host != "local":
        return []
    config = _model_config(cfg.target.model_path)
    if config is None:
        if cfg.target.shape is None and cfg.data.hidden_states != "online":
            return [Finding("error", "target_shape", f"{cfg.target.model_path}/config.json is not readable here: "
                            "declare target.shape (the disk bound of the hidden states needs hidden_size)",
                            "target.model_path")]
        return []
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    context, vocab = text.get("max_position_embeddings"), text.get("vocab_size")
    findings = []
    if isinstance(context, int) and cfg.data.max_length > context:
        findings.append(Finding("error", "target_context", f"{cfg.data.max_length} exceeds the target's context "
                                f"(max_position_embeddings {context} in {cfg.target.model_path}/config.json)",
                                "data.max_length"))
    if isinstance(vocab, int) and cfg.data.draft_vocab_size > vocab:
        findings.append(Finding("error", "target_vocab", f"{cfg.data.draft_vocab_size} exceeds the target's "
                                f"vocabulary (vocab_size {vocab} in {cfg.target.model_path}/config.json)",
                                "data.draft_vocab_size"))
    return findings


# ------------------------------------------------------------------ lengths


def served_context(cfg: ExperimentConfig) -> tuple[int | None, str]:
    """(tokens, where that figure comes from) of the served model's context, as far as it is known here."""
    if cfg.deploy.server == "sglang":
        flag = _last_value(cfg.deploy.extra_args, "--context-length")
        if flag is not None and flag.isdigit():
            return int(flag), "--context-length in deploy.extra_args"
    field = "deploy.model_path" if cfg.deploy.model_path else "target.model_path"
    folder = cfg.deploy.model_path or cfg.target.model_path
    config = _model_config(folder)
    if config is not None:
        text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
        context = text.get("max_position_embeddings")
        return (context, f"max_position_embeddings of {folder}/config.json ({field})") \
            if isinstance(context, int) and context > 0 else (None, "")
    if cfg.deploy.model_path and cfg.deploy.model_path != cfg.target.model_path:
        return None, ""  # another model than the target is served: its context is read on its host
    if cfg.target.shape:
        return cfg.target.shape.max_position_embeddings, "target.shape.max_position_embeddings"
    if cfg.target.kind == "tiny":
        return cfg.target.tiny.max_position_embeddings, "target.tiny.max_position_embeddings"
    return None, ""


def bench_length_findings(cfg: ExperimentConfig) -> list[Finding]:
    """A prompt holds at least one token, so bench.max_new_tokens + 1 must fit the trained length (builtin
    prompts) and the served context; the benchmark stage checks each rendered prompt against the same limits."""
    answer, field = cfg.bench.max_new_tokens, "bench.max_new_tokens"
    findings = []
    if cfg.bench.prompts == "builtin" and answer + 1 > cfg.data.max_length:
        findings.append(Finding("error", "bench_lengths", f"{answer} new tokens after a prompt of at least one token "
                                f"exceed data.max_length {cfg.data.max_length}, the length the draft was trained "
                                "on, which the builtin prompts stay within: lower bench.max_new_tokens", field))
    context, source = served_context(cfg)
    if context is not None and answer + 1 > context:
        findings.append(Finding("error", "bench_lengths", f"{answer} new tokens after a prompt of at least one token "
                                f"exceed the served context of {context} tokens ({source}): the server would "
                                "refuse every request; lower bench.max_new_tokens", field))
    return findings


def _last_value(args: list[str], flag: str) -> str | None:
    value = None
    for i, arg in enumerate(args):
        name, eq, given = arg.partition("=")
        if name == flag:
            value = given if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def _model_config(folder: str | None) -> dict | None:
    """A model folder's config.json when it is readable here (validate_launch names one that is broken)."""
    try:
        return read_model_config(folder) if folder else None
    except ValueError:
        return None


# ------------------------------------------------------------------ files


def file_findings(cfg: ExperimentConfig) -> list[Finding]:
    """The prompt files and the initial checkpoint the stages read on this machine."""
    findings = []
    if cfg.bench.prompts != "builtin":
        findings += prompt_file_findings(cfg.bench.prompts, "bench.prompts")
    if cfg.data.source == "prompts" and cfg.data.host == "local" and cfg.data.prompts != "builtin":
        findings += prompt_file_findings(cfg.data.prompts, "data.prompts")
    init = cfg.train.init_checkpoint
    if init and not Path(init).expanduser().exists():
        findings.append(Finding("error", "init_checkpoint", f"{init} does not exist here (training starts from it, "
                                "and uploads it to remote nodes from here)", "train.init_checkpoint"))
    return findings


def prompt_file_findings(path: str, field: str) -> list[Finding]:
    """A .jsonl of prompts: a readable file of JSON objects, one a line (its first 8 MiB read), not empty."""
    file = Path(path).expanduser()
    try:
        with file.open("rb") as fh:
            head = fh.read(PROMPT_FILE_CHECKED_BYTES + 1)
    except FileNotFoundError:
        return [Finding("error", "prompt_file", f"{path}: file not found", field)]
    except OSError as err:  # a directory, no permission
        return [Finding("error", "prompt_file", f"{path}: cannot read ({err.strerror or err})", field)]
    lines = head.split(b"\n")
    if len(head) > PROMPT_FILE_CHECKED_BYTES:
        lines = lines[:-1]  # cut mid-line
    records = 0
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            reason = "not UTF-8" if isinstance(err, UnicodeDecodeError) else f"invalid JSON ({err.msg})"
            return [Finding("error", "prompt_file", f"{path}:{number}: {reason}", field)]
        if not isinstance(record, dict):
            return [Finding("error", "prompt_file", f"{path}:{number}: expected a JSON object with a prompt, found "
                            f"a {type(record).__name__}", field)]
        records += 1
    if not records:
        return [Finding("error", "prompt_file", f"{path}: no prompts", field)]
    return []

