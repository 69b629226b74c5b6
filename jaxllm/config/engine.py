"""One engine configuration: what an engine is built from (the model, its formats, the context, the
mesh, the KV memory's block size, speculation, the runtime's backend choices, the compilation
cache), each field's default and check written once in `EngineConfig`, and each field's flag (its
spellings, type and help) once in `FLAGS`.

Every command line builds its model flags from `FLAGS` (`add_flags`), adds only its own (the
server's HTTP options, the bench's sweep), and turns what it parsed into an `EngineConfig`
(`from_args`, where the environment is read, once); `jaxllm.load` takes the same object or its
fields, and `engine.build.build_engine` builds every engine from it. Nothing here imports JAX, so a
front end refuses a bad flag before JAX loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Callable

from jaxllm.config.kv import KV_QUANT_MODES, KVOptions
from jaxllm.config.model import CTX_CAP
from jaxllm.config.runtime import KERNELS, LAYER_SCANS, SWITCH, WIDEN_ONCE, WIDENINGS, Caches, RuntimeConfig
from jaxllm.errors import ModelError

DTYPES = ("bfloat16", "float32")
QUANTS = ("int8", "fp8", "none")
SPECULATIVE_METHODS = ("ngram", "draft")


def _positive_integer(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1


def check_speculative(method, k, draft) -> None:
    """The speculative fields (`draft`: the draft model, a directory or a random shape), before any loading."""
    if method is None:
        if draft is not None:
            raise ModelError("a draft model is used with speculative decoding: add --speculative draft")
        return
    check_method(method, k)
    if (method == "draft") != (draft is not None):
        raise ModelError("--speculative draft takes a --draft-model-dir, and only it does")


def check_method(method, k) -> None:
    if method not in SPECULATIVE_METHODS:
        raise ModelError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
        raise ModelError(f"num_speculative_tokens must be an integer from 1 to 16, got {k!r}")


@dataclass(frozen=True)
class EngineConfig:
    """What an engine is built from.

    model_dir: an HF directory, .gguf file, saved jaxllm checkpoint or hub id; None (and no
      `shape`) is the embedded Gemma 3 270M.
    shape: instead of a model, random weights of a named architecture (a preset such as qwen3-4b, or
      a config.json path; `shape_overrides` replace some of its fields), for benchmarks: prompts are
      token ids unless `tokenizer` names a directory with a tokenizer.json; `seed` draws the weights.
    dtype, quant: the compute dtype and the weights' format on the device (bfloat16 with int8
      weights is the fastest of the four on GPUs and on a CPU alike); "fp8" keeps the layers'
      matmul weights float8_e4m3fn with a scale per 128 x 128 block, as FP8 checkpoints store them
      (others are quantized so at load), and XLA scales them as each matmul reads them.
    kv_quant: "auto" keeps KV in the compute dtype up to `kv_options.threshold` (32768) positions
      and global layers' KV in int8 above; "int8" always; "none" never.
    max_ctx: the longest sequence (prompt and new tokens); None: the model's trained length, at
      most 8192.
    tp, dp: devices on the "model" axis (None: every local device) and on the "data" axis.
    kv_options: the KV memory's tunables (`KVOptions`; `--block-size` sets its block size).
    speculative: None, "ngram" or "draft" (drafts from `draft_model_dir`, or from random weights of
      `draft_shape` with a random `shape`), `num_speculative_tokens` a cycle, cycles with more than
      `speculative_max_batch` live rows decode plainly (None: no limit); `draft_always` keeps every
      row drafting whatever it accepts (the cost of a cycle, for benchmarks).
    runtime: the backend's choices (`RuntimeConfig`).
    caches: where compiled steps and models built from GGUF files are kept (`Caches`; the default
      keeps nothing: front ends and `jaxllm.load` pass `Caches.from_env`, whose compilation cache
      `--compilation-cache` moves or turns off).
    """

    model_dir: str | None = None
    shape: str | None = None
    tokenizer: str | None = None
    dtype: str = "bfloat16"
    quant: str = "int8"
    kv_quant: str = "auto"
    max_ctx: int | None = None
    tp: int | None = None
    dp: int = 1
    kv_options: KVOptions | None = None
    speculative: str | None = None
    num_speculative_tokens: int = 4
    draft_model_dir: str | None = None
    draft_shape: str | None = None
    speculative_max_batch: int | None = 4
    draft_always: bool = False
    seed: int = 0
    shape_overrides: dict = field(default_factory=dict)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    caches: Caches = field(default_factory=Caches)

    def __post_init__(self):
        if self.model_dir is not None and self.shape is not None:
            raise ModelError("--model-dir and --shape name two models: give one")
        if self.tokenizer is not None and self.shape is None:
            raise ModelError("--tokenizer goes with --shape (a model directory brings its own)")
        if self.shape_overrides and self.shape is None:
            raise ModelError("shape_overrides go with a random shape")
        if self.dtype not in DTYPES:
            raise ModelError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quant not in QUANTS:
            raise ModelError(f"quant must be one of {', '.join(QUANTS)}, got {self.quant!r}")
        if self.kv_quant not in KV_QUANT_MODES:
            raise ModelError(f"kv_quant must be one of {', '.join(KV_QUANT_MODES)}, got {self.kv_quant!r}")
        if self.max_ctx is not None and (not _positive_integer(self.max_ctx) or self.max_ctx < 2):
            raise ModelError(
                f"max_ctx (--max-ctx, --max-model-len) must be an integer of at least 2, got {self.max_ctx!r}"
            )
        if self.tp is not None and not _positive_integer(self.tp):
            raise ModelError(f"tp must be a positive integer or None, got {self.tp!r}")
        if not _positive_integer(self.dp):
            raise ModelError(f"dp must be a positive integer, got {self.dp!r}")
        if self.kv_options is not None and not isinstance(self.kv_options, KVOptions):
            raise ModelError(f"kv_options must be a KVOptions, got {type(self.kv_options).__name__}")
        if not isinstance(self.runtime, RuntimeConfig):
            raise ModelError(f"runtime must be a RuntimeConfig, got {type(self.runtime).__name__}")
        if not isinstance(self.caches, Caches):
            raise ModelError(f"caches must be a Caches, got {type(self.caches).__name__}")
        if self.draft_shape is not None and self.draft_model_dir is not None:
            raise ModelError("a draft model is --draft-shape or --draft-model-dir, not both")
        if self.draft_shape is not None and self.shape is None:
            raise ModelError("--draft-shape drafts for a random --shape")
        if self.draft_always and not (self.speculative and self.shape):
            raise ModelError("--draft-always measures a cycle of --speculative on a random --shape")
        mb = self.speculative_max_batch
        if mb is not None and not _positive_integer(mb):
            raise ModelError(f"speculative_max_batch must be a positive integer or None, got {mb!r}")
        check_speculative(self.speculative, self.num_speculative_tokens, self.draft_model_dir or self.draft_shape)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @property
    def name(self) -> str | None:
        """A random shape's name (a model's comes from its files)."""
        return None if self.shape is None else f"{self.shape} (random weights)"


# -- command-line flags ------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of usage + error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def max_batch(s: str):
    return None if s == "none" else positive_int(s)


def unroll(s: str):
    return "full" if s == "full" else positive_int(s)


def switch(s: str) -> bool:

    if s.lower() not in SWITCH:
        raise argparse.ArgumentTypeError(f"expected on or off, got {s!r}")
    return SWITCH[s.lower()]


@dataclass(frozen=True)
class Flag:
    """A field's command-line flag: its spellings (the first names the field in messages), help,
    and argparse's type or choices. `runtime`: a `RuntimeConfig` field (unset, its environment
    variable's value); `kv`: a `KVOptions` field; `caches`: an argument of `Caches.from_env`."""

    names: tuple[str, ...]
    help: str
    type: Callable | None = None
    choices: tuple | None = None
    metavar: str | None = None
    runtime: bool = False
    kv: bool = False
    caches: bool = False


FLAGS: dict[str, Flag] = {
    "model_dir": Flag(
        ("--model-dir",),
        "HF model directory, .gguf file, saved jaxllm checkpoint or hub id (default: the embedded Gemma 3 270M)",
        metavar="PATH",
    ),
    "shape": Flag(
        ("--shape",),
        "random weights of a named architecture (a preset such as qwen3-4b, or a "
        "config.json path) instead of a model: prompts as token ids, text as the generated ids",
        metavar="NAME",
    ),
    "tokenizer": Flag(
        ("--tokenizer",), "with --shape: a directory whose tokenizer.json gives the model text", metavar="DIR"
    ),
    "dtype": Flag(("--dtype",), "activation and compute dtype", choices=DTYPES),
    "quant": Flag(
        ("--quant",), "weight format on the device (fp8: the layers' weights in 128x128 blocks)", choices=QUANTS
    ),
    "kv_quant": Flag(
        ("--kv-quant",),
        "KV format: auto = the compute dtype up to 32,768 positions, int8 global layers above",
        choices=KV_QUANT_MODES,
    ),
    "max_ctx": Flag(
        ("--max-ctx", "--max-model-len"),
        f"the longest sequence, prompt and new tokens (default: the model's trained length, at most {CTX_CAP})",
        type=positive_int,
        metavar="N",
    ),
    "tp": Flag(
        ("--tp",), "tensor-parallel degree over local devices (default: all of them)", type=positive_int, metavar="N"
    ),
    "dp": Flag(("--dp",), "data-parallel degree (devices splitting the batch)", type=positive_int, metavar="N"),
    "block_size": Flag(
        ("--block-size",),
        "positions a KV block holds (a power of two, default 64): the unit of allocation and of prefix reuse",
        type=positive_int,
        kv=True,
        metavar="N",
    ),
    "speculative": Flag(
        ("--speculative",),
        "draft tokens by n-gram lookup in the sequence itself, or with a draft model (--draft-model-dir)",
        choices=SPECULATIVE_METHODS,
    ),
    "num_speculative_tokens": Flag(
        ("--num-speculative-tokens",), "tokens drafted a cycle (1 to 16)", type=positive_int, metavar="K"
    ),
    "draft_model_dir": Flag(
        ("--draft-model-dir",), "the draft model: a smaller model sharing the tokenizer", metavar="PATH"
    ),
    "draft_shape": Flag(
        ("--draft-shape",), "with --shape: random weights of this architecture as the draft model", metavar="NAME"
    ),
    "speculative_max_batch": Flag(
        ("--speculative-max-batch",),
        "speculate while at most this many rows decode, else decode plainly ('none': any)",
        type=max_batch,
        metavar="N",
    ),
    "seed": Flag(
        ("--seed",),
        "the run's seed: random --shape weights, sampling (row b of a batch samples with seed + b) "
        "and a bench's prompts",
        type=int,
        metavar="S",
    ),
    "draft_always": Flag(
        ("--draft-always",),
        "rows draft every cycle however little they accept (the cost of a "
        "cycle); by default rows whose drafts fail stop drafting, as in serving",
    ),
    "kernels": Flag(
        ("--kernels",),
        "the Pallas kernels on GPUs and TPUs (auto), nowhere (xla), or everywhere "
        "(pallas; interpreted on a CPU) (default: $JAXLLM_KERNELS, else auto)",
        choices=KERNELS,
        runtime=True,
    ),
    "layer_scan": Flag(
        ("--layer-scan",),
        "how the layer scan reaches sliding and global layers (default: $JAXLLM_LAYER_SCAN, else auto)",
        choices=LAYER_SCANS,
        runtime=True,
    ),
    "scan_unroll": Flag(
        ("--scan-unroll",),
        "layers per iteration of the layer scan: a count or full (default: $JAXLLM_SCAN_UNROLL, else chosen per step)",
        type=unroll,
        runtime=True,
        metavar="N",
    ),
    "int8_widen": Flag(
        ("--int8-widen",),
        "how GPU kernels widen int8 (default: $JAXLLM_INT8_WIDEN, else each kernel's own)",
        choices=WIDENINGS,
        runtime=True,
    ),
    "triton_gemm": Flag(
        ("--triton-gemm",),
        "on | off: XLA's autotuned Triton GEMMs on GPUs beside cuBLAS (default: $JAXLLM_TRITON_GEMM, else off)",
        type=switch,
        metavar="{on,off}",
        runtime=True,
    ),
    "widen_once": Flag(
        ("--widen-once",),
        "int8 weights widened once a GPU decode call for XLA's GEMMs (default: $JAXLLM_WIDEN_ONCE, else auto)",
        choices=WIDEN_ONCE,
        runtime=True,
    ),
    "compilation_cache": Flag(
        ("--compilation-cache",),
        "the folder of compiled steps kept across runs, or off "
        "(default: $JAXLLM_COMPILATION_CACHE, else ~/.cache/jaxllm/xla)",
        metavar="DIR",
        caches=True,
    ),
}
# Flags of the front ends' own that several of them take, each with one meaning: not engine fields.
FRONT: dict[str, Flag] = {
    "json": Flag(("--json",), "JSON on stdout (one object per result), no other stdout"),
    "out": Flag(
        ("--out",),
        "where results go: the new directory of a converted model, or a bench's JSON file "
        "(default for a bench: a new file under the user's cache, ~/.cache/jaxllm/bench/)",
        metavar="PATH",
    ),
}
MODEL = ("model_dir", "dtype", "quant", "kv_quant", "max_ctx", "tp")
SPECULATION = ("speculative", "num_speculative_tokens", "draft_model_dir", "speculative_max_batch")
RUNTIME = tuple(k for k, f in FLAGS.items() if f.runtime)
CACHES = tuple(k for k, f in FLAGS.items() if f.caches)
BOOLEAN = ("draft_always",)


def default_of(name: str):
    if FLAGS[name].caches:
        return None  # the environment's (`Caches.from_env`)
    if FLAGS[name].runtime:
        return getattr(RuntimeConfig(), name)
    if FLAGS[name].kv:
        return getattr(KVOptions(), name)
    f = EngineConfig.__dataclass_fields__[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def add_flags(parser: argparse.ArgumentParser, names, group: str | None = None, first: dict | None = None) -> None:
    """The flags of the fields `names` (in that order), each unset unless given (None), so that
    `from_args` knows what the user chose, and of the front ends' shared flags (`FRONT`); `first`
    names a field's spelling to show first (the server's --max-model-len, as vLLM spells it)."""
    g = parser.add_argument_group(group) if group else parser
    for name in names:
        if name in FRONT:
            f = FRONT[name]
            if name == "json":
                g.add_argument(*f.names, dest=name, action="store_true", help=f.help)
            else:
                g.add_argument(*f.names, dest=name, default=None, metavar=f.metavar, help=f.help)
            continue
        f = FLAGS[name]
        default = default_of(name)
        plain = default is None or "default" in f.help or name in BOOLEAN
        shown = f.help if plain else f"{f.help} (default: {default})"
        if name in BOOLEAN:
            g.add_argument(*f.names, dest=name, action="store_true", default=None, help=shown)
            continue
        kw = {"type": f.type} if f.type else {}
        spellings = sorted(f.names, key=lambda n: n != (first or {}).get(name))
        g.add_argument(*spellings, dest=name, default=None, choices=f.choices, metavar=f.metavar, help=shown, **kw)


def from_args(args: argparse.Namespace, **fields) -> EngineConfig:
    """The configuration the parsed flags name (what was not given keeps its default; the runtime's
    fields and the caches not given come from the environment, read here), with `fields` on top."""
    given = {k: v for k, v in vars(args).items() if k in FLAGS and v is not None}
    runtime = RuntimeConfig.from_env(**{k: given.pop(k) for k in RUNTIME if k in given})
    caches = Caches.from_env(**{k: given.pop(k) for k in CACHES if k in given})
    kv = {k: given.pop(k) for k in [k for k in given if FLAGS[k].kv]}
    if kv:
        given["kv_options"] = dataclasses.replace(fields.pop("kv_options", None) or KVOptions(), **kv)
    return EngineConfig(**{"runtime": runtime, "caches": caches, **given, **fields})


def value_of(config: EngineConfig, name: str):
    """The value of the flag `name` in `config`."""
    if name == "compilation_cache":
        return str(config.caches.compilation or "off")
    if FLAGS[name].runtime:
        return getattr(config.runtime, name)
    if FLAGS[name].kv:
        return getattr(config.kv_options or KVOptions(), name)
    return getattr(config, name)


def settle(args: argparse.Namespace, config: EngineConfig) -> None:
    """Write `config`'s values back onto the parsed flags it was built from (a flag left unset reads
    as its default from then on)."""
    for name in FLAGS:
        if hasattr(args, name):
            setattr(args, name, value_of(config, name))


def to_flags(config: EngineConfig, names) -> list[str]:
    """The command line that gives `names` of `config` where they differ from their defaults (a
    front end starting another, as the serving bench starts the server)."""
    out = []
    for name in names:
        f = FLAGS[name]
        value = value_of(config, name)
        if value is None and not (name == "speculative_max_batch" and value != default_of(name)):
            continue
        if value == default_of(name) and not f.runtime:
            continue
        if name in BOOLEAN:
            out += [f.names[0]] if value else []
        elif isinstance(value, bool):
            out += [f.names[0], "on" if value else "off"]
        else:
            out += [f.names[0], "none" if value is None else str(value)]
    return out
