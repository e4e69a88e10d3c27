"""The doorbell's edges in one process (tests/mpi/test_doorbell.py rings across real ranks): a bell
rung many times is one wake-up, and a bell closed while a thread sleeps on it (the run ending) raises
nowhere; once closed, a sleep is a plain sleep."""
import os
import socket
import threading

from yatt_hpc.comm.doorbell import Doorbell


def _bound(tag: str) -> Doorbell:
    bell = Doorbell()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(f"\0yatt-test-{os.getpid()}-{tag}".encode())
    sock.setblocking(False)
    bell._sock, bell._addresses = sock, {1: f"\0yatt-test-{os.getpid()}-{tag}".encode()}
    return bell


def test_many_rings_wake_one_sleep_and_are_cleared():
    bell = _bound("many")
    for _ in range(10_000):  # far more than the socket buffers: the rest are dropped, never raised
        bell._ring_world([1, 7])  # 7: a rank on another node, not rung
    assert bell.sleep(5.0) and bell.rung == 1
    assert not bell.sleep(0.01), "the bell was cleared by the wake-up"
    bell.close()


def test_closing_while_a_thread_sleeps_raises_nowhere():
    bell, errors = _bound("close"), []

    def sleeper():
        try:  # in select when the socket closes, or after it (then a plain sleep): both must just return
            for _ in range(20):
                bell.sleep(0.02)
        except Exception as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    thread = threading.Thread(target=sleeper)
    thread.start()
    bell.close()
    thread.join(timeout=30)
    assert not errors and not thread.is_alive()
    assert not bell.enabled and bell.sleep(0.001) is False
    bell._ring_world([1])  # closed: nothing to ring with, no error
