"""Test setup: CPU only, 8 simulated devices, exact f32 matmuls; shared fixtures."""

import os

from subprocs import xla_flags

# Tests marked `real` read the real Qwen2.5-Coder-0.5B-Instruct from this directory
# (`make test-real` fetches it there); without it they are skipped.
REAL_MODEL_ENV = "SEM_JAX_REAL_MODEL"

# Before jax is imported anywhere: 8 host devices for the multi-device tests, LLVM at -O0 (see
# subprocs.py; not for the real-model checks, which are execution-bound), and never try an
# accelerator (libtpu prints errors on a CPU host when jax[tpu] is in).
if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = xla_flags(8, fast_compile=REAL_MODEL_ENV not in os.environ)
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent XLA compilation cache for the session and the CLI subprocesses the tests start
# (they inherit the environment): most of a subprocess test's time is compiling programs that an
# earlier test or process already compiled. Inside the checkout, so that a fresh clone starts empty.
# Every program, however fast it compiles: a CLI run compiles about 90 small ones (slices,
# broadcasts, random inits; 30-100 ms each), about 3 s a process when none is cached.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_configure(config):
    config.addinivalue_line("markers", "real: needs the real Qwen2.5 checkpoint (make test-real)")


# The files with the longest tests (their CLI runs compile), in the order `make test`'s two
# workers should take them up: whole files go to whichever worker is free (--dist loadfile), and
# longest first leaves no worker running one long file alone at the end.
LONG_FILES = ("test_train.py", "test_demo.py", "test_data_eval_export.py", "test_scale.py", "test_qwen3_pipeline.py",
              "test_grpo.py", "test_lora.py", "test_faults.py", "test_sft.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable: file order kept within
    if os.environ.get(REAL_MODEL_ENV):
        return
    skip = pytest.mark.skip(reason=f"real-model test: run `make test-real` (or set {REAL_MODEL_ENV}=DIR)")
    for item in items:
        if "real" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def real_model_dir():
    path = os.environ[REAL_MODEL_ENV]
    if not os.path.exists(os.path.join(path, "sem_jax_source.json")):
        pytest.fail(f"{path}: not a finished real-model directory; run "
                    f"`python scripts/fetch_real_model.py --out {path}`")
    return path


@pytest.fixture(scope="session")
def real_report():
    """Figures the real-model tests measured, written to $SEM_JAX_REAL_REPORT (JSON) at the end."""
    import json

    report: dict = {}
    yield report
    out = os.environ.get("SEM_JAX_REAL_REPORT")
    if out and report:
        with open(out, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)


def write_hf_qwen2(path, *, seed=0, max_shard_size="5GB", dtype="float32", family="Qwen2", **overrides):
    """Random-weight Qwen2 (or `family` Qwen3) written by `transformers` itself; returns the torch
    model (eval)."""
    import torch
    import transformers

    kw = dict(vocab_size=320, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
              num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False,
              rope_theta=1e6, max_position_embeddings=256, rms_norm_eps=1e-6)
    kw.update(overrides)
    cfg = getattr(transformers, f"{family}Config")(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    # HF initialises biases to 0 and norms to 1; randomise everything so that a
    # wrong bias, norm or transpose cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(str(path), max_shard_size=max_shard_size)
    return model


def write_hf_qwen3(path, **kw):
    """Random-weight Qwen3 written by `transformers` itself (head_dim apart from hidden / heads
    unless overridden); returns the torch model (eval)."""
    return write_hf_qwen2(path, family="Qwen3", **{"head_dim": 16, **kw})


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


@pytest.fixture(scope="session")
def qwen25_tokenizer():
    from sem_jax.model.tokenizer import build_qwen25_tokenizer
    return build_qwen25_tokenizer()


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    from sem_jax.model.tokenizer import build_qwen3_tokenizer
    return build_qwen3_tokenizer()


@pytest.fixture(scope="session")
def qwen3_special_tags_tokenizer():
    """Qwen3's vocabulary with its four added tags marked special (as a fine-tune may mark them):
    decoding with `skip_special_tokens` would drop them."""
    from sem_jax.model import tokenizer as t
    return t._build_qwen(t.QWEN25_ADDED_TOKENS + tuple((c, True) for c, _ in t.QWEN3_ADDED_TOKENS[len(t.QWEN25_ADDED_TOKENS):]),
                         t.QWEN3_CHAT_TEMPLATE, None)


# The tags as several BPE pieces (Qwen2.5), one added token (Qwen3), one special token.
TOKENIZERS = ("qwen25_tokenizer", "qwen3_tokenizer", "qwen3_special_tags_tokenizer")


@pytest.fixture(params=TOKENIZERS, ids=lambda name: name.removesuffix("_tokenizer"))
def qwen_tokenizer(request):
    """Each of `TOKENIZERS` in turn, for the tests whose protocol code must work on all three."""
    return request.getfixturevalue(request.param)
