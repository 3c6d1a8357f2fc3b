import os

# Offline and interpreter settings must be in place before transformers / triton kernels import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models: thread start-up costs more than it saves, and oversubscription on 2 shared cores is very slow.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# a real-text corpus, a tiny BPE tokenizer and tiny checkpoints for the training, conversion and lm-eval tests; each
# in-process train() gets a fresh Accelerate state
from tests.fixtures.training import (  # noqa: E402,F401
    _fresh_accelerate_state,
    chat_config_json,
    chat_data,
    chat_tokenizer_dir,
    checkpoint_dir,
    config_json,
    corpus,
    moh_llama_type,
    tokenizer_dir,
)


@pytest.fixture(scope="session")
def warm():
    """Command lines forked from a server that imported torch, Transformers and mhmoe once (tests/fixtures/warm.py):
    each pytest process starts it on first use."""
    from tests.fixtures.warm import WarmServer, cli_env

    server = WarmServer(cli_env())
    yield server
    server.close()


@pytest.fixture(scope="session")
def warm_blocked(tmp_path_factory):
    """As `warm`, in an environment where `import mhmoe` (and triton) fail: exported folders loaded with
    trust_remote_code (tests/fixtures/remote_code.py); a launch with `env=None` gets the server's environment."""
    from tests.fixtures.remote_code import BLOCKED_PRELOAD, blocked_env
    from tests.fixtures.warm import WarmServer

    server = WarmServer(blocked_env(tmp_path_factory.mktemp("blocked")), preload=BLOCKED_PRELOAD)
    yield server
    server.close()
