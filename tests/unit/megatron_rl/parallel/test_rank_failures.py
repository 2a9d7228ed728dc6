"""The one line a failed job reports: the cause named first, a long traceback cut in its middle."""
from elastic.runtime.runtime import ElasticFault
from megatron_rl.parallel.rank_failures import CAUSE_CHARS, RankFailure, clipped, describe, failure_of, peer_reaction

GLHF = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:8874. This is typically caused by a remote worker crashing. Check the logs of the remote "
        "worker before reporting an error. GLHF!")


def _raised(e: BaseException, cause: BaseException | None = None) -> BaseException:
    try:
        raise e from cause
    except BaseException as caught:  # noqa: BLE001  (the object, with its traceback and chain)
        return caught


def _deep_bug(depth: int):
    """A bug raised while handling `depth` other errors: a traceback of many frames and long lines."""
    try:
        if depth:
            _deep_bug(depth - 1)
        raise ValueError("what was being handled " + "x" * 3000)
    except (ValueError, KeyError):
        raise KeyError("a bug")  # noqa: B904  (the chain is the point: a long traceback)


def test_a_collectives_reaction_to_a_dead_peer_is_not_a_cause():
    gloo = _raised(RuntimeError(GLHF))
    assert peer_reaction(gloo) and peer_reaction(_raised(ElasticFault(0, 1, "decode", gloo), gloo))
    assert not peer_reaction(_raised(KeyError("a bug")))
    # a rank's own error, and a peer's death noticed while it was being handled: the rank's own
    assert not peer_reaction(_raised(RuntimeError(GLHF), _raised(ValueError("bad shape"))))
    nccl = _raised(RuntimeError("NCCL communicator was aborted on rank 3."))
    assert failure_of(nccl, 3, None).reaction


def test_the_cause_comes_first_whatever_arrived_first():
    reaction = failure_of(_raised(RuntimeError(GLHF)), 0, None)
    try:
        _deep_bug(0)
    except KeyError as e:
        bug = failure_of(e, 1, None)
    line = describe([reaction, bug])
    assert line.startswith("rank 1 failed: Traceback") and line.endswith(
        "KeyError: 'a bug'; rank 0 reported: RuntimeError: " + GLHF), line
    assert describe([reaction, RankFailure(2, "died", "exit code -9"), bug]).startswith("rank 2 died (exit code -9)")
    assert describe([reaction]).startswith("rank 0 failed: Traceback")  # nothing else: the reaction itself


def test_a_long_traceback_keeps_its_exception_line():
    try:
        _deep_bug(5)
    except KeyError as e:
        bug = failure_of(e, 0, None)
    assert len(bug.message) > 3 * CAUSE_CHARS
    line = describe([bug])
    assert len(line) < CAUSE_CHARS + 100 and line.endswith("KeyError: 'a bug'"), line
    assert line.startswith("rank 0 failed: Traceback (most recent call last): ... (") and "characters cut" in line
    own = "E" * 5000  # an exception whose own line is longer than the whole budget: its start
    assert clipped("Traceback\n  File x\nValueError: " + own, 300).startswith("ValueError: EEE")
