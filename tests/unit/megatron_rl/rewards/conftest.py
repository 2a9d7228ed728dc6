"""A custom reward runs in this process's shared reward workers: each test ends its own."""
import pytest

from megatron_rl.user_code.pool import close_shared_pools


@pytest.fixture(autouse=True)
def _end_reward_workers():
    yield
    close_shared_pools()
