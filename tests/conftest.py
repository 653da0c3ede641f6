"""Shared fixtures: tiny real models built in the test session (no network, no downloads), and the three tiers.

Every test is in one tier: `e2e` (marked by hand: flows, request service, CLI, bench, wheels), else `model` (it
uses a model fixture below: tiny-model behaviour stated as contracts), else `math` (pure math and data, seconds).
`make test-math`, `make test-fast` (math and model) and `make test` (all) run them."""

import os
import tempfile

# Prefect and MLflow read their settings at import: point them at throwaway places before anything imports them.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="grom-test-prefect-"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

# Prefect configures logging with dictConfig when its API is first imported, which closes every handler that
# exists then. Imported here, before any test module is collected, it cannot close a handler that another library
# (absl, which grom_core's metrics import) bound to one of pytest's capture files.
import pytest  # noqa: E402
import torch  # noqa: E402
from prefect import flow  # noqa: E402, F401
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from grom_core.benchmarks.authors import author_questions, make_authors, qa_pairs  # noqa: E402
from grom_core.finetune import TinyModelConfig, TrainConfig, train_tiny_model, train_tokenizer  # noqa: E402
from grom_core.loading import load_model  # noqa: E402
from grom_core.quantization import bitsandbytes_available  # noqa: E402

# The FP4/NF4 and int8 attacks need bitsandbytes (declared for Linux x86_64 only); rtn4 runs everywhere.
HAS_BITSANDBYTES = bitsandbytes_available()
needs_bitsandbytes = pytest.mark.skipif(not HAS_BITSANDBYTES, reason="bitsandbytes is not installed (no wheel for "
                                        "this platform): the FP4, NF4 and int8 attacks cannot run")
ATTACK = "fp4" if HAS_BITSANDBYTES else "rtn4"  # the 4-bit attack a test runs: FP4 where it can

MODEL_FIXTURES = {"trained", "trained_dir", "tiny_llama", "tiny_gpt2", "small_workspace", "smollm2", "smollm2_home",
                  "harness"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("e2e") is None:
            item.add_marker(pytest.mark.model if MODEL_FIXTURES & set(item.fixturenames) else pytest.mark.math)


# The memorisation fixture: 8 authors x 8 questions, 2 authors forgotten. Trains in about 10 s on 2 cores.
AUTHORS = make_authors(8, seed=1)
FORGET = [ex for a in AUTHORS[:2] for ex in author_questions(a)]
RETAIN = [ex for a in AUTHORS[2:] for ex in author_questions(a)]
MODEL_CONFIG = TinyModelConfig(vocab_size=400, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                               max_length=96)
TRAIN_CONFIG = TrainConfig(epochs=60, lr=3e-3, batch_size=16)


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer([f"Question: {e.question}\nAnswer: {e.answer}" for e in qa_pairs(AUTHORS)], 400)


@pytest.fixture(scope="session")
def trained_dir(tmp_path_factory):
    torch.set_num_threads(2)
    return train_tiny_model(qa_pairs(AUTHORS), tmp_path_factory.mktemp("models"), model_config=MODEL_CONFIG,
                            train_config=TRAIN_CONFIG)


@pytest.fixture()
def trained(trained_dir):
    """(model, tokenizer) freshly loaded for each test, so no test sees another's edits."""
    return load_model(trained_dir, device="cpu")


def random_llama(tokenizer, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
               pad_token_id=tokenizer.pad_token_id)
    cfg.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def random_gpt2(tokenizer, seed=0):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=3, n_head=4, n_positions=128,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id)
    return GPT2LMHeadModel(cfg).eval()


@pytest.fixture()
def tiny_llama(tokenizer):
    return random_llama(tokenizer)


@pytest.fixture()
def tiny_gpt2(tokenizer):
    return random_gpt2(tokenizer)


@pytest.fixture(scope="session")
def small_workspace(tmp_path_factory):
    """One workspace for the tests that need a built (10-author) minitofu: its models are trained once."""
    return tmp_path_factory.mktemp("small-ws")


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2 converted from its GGUF once (about 25 s), into the models/ folder of a workspace
    (`smollm2_home`) shared by every test that needs the real model."""
    from tasks.models import fetch_model

    return fetch_model("smollm2", tmp_path_factory.mktemp("smollm2-ws") / "models")


@pytest.fixture(scope="session")
def smollm2_home(smollm2):
    from pathlib import Path

    return Path(smollm2.model_dir).parent.parent


@pytest.fixture(scope="session")
def harness():
    """One Prefect test server for the whole session (it takes 15-25 s to start on 2 cores)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def run_grom(capsys, monkeypatch, *args):
    """Run `grom ARGS` in this process through the console script's entry point; returns (exit code, stdout,
    stderr): exactly what a user sees."""
    import sys

    from flows import cli

    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["grom", *args])
    code = 0
    try:
        cli.main()
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err
