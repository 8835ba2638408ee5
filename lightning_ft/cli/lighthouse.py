"""``lightning-ft lighthouse``: run torchft's lighthouse, the server that joins replica groups into a quorum.

Replica groups (``ElasticFT3D(replica_groups=...)``, docs/replica-groups.md) find each other through one lighthouse per
job. This command starts torchft's own (:class:`torchft.coordination.LighthouseServer`, the Rust server behind
torchft's ``torchft_lighthouse``) bound to ``--bind``, prints the one line the groups need,
``TORCHFT_LIGHTHOUSE=http://HOST:PORT``, on stdout, and serves until SIGTERM or SIGINT, then shuts it down and exits
with 0. Every option is checked before anything is bound (a bad value is a usage error, exit code 2, one line naming
the option), and an address already in use or one the host does not have is a usage error too, reported before the
address line is printed.

It differs from ``torchft_lighthouse`` in four ways, each for the replica mode: the durations are seconds, as the
rest of lightning-ft takes them; the default heartbeat timeout is 1 s instead of torchft's 5 s, because a dead group
holds the survivors' next quorum until its heartbeat times out (measured here: 5.2-10.8 s of stall with 5 s, 1.3 s
with 1 s); the default join timeout is 1 s instead of torchft's 60 s, because a replacement group heartbeats while it
still starts (imports, model set-up) and the survivors' quorum waits for it up to the join timeout; and the address
printed is the one bound (``--bind 127.0.0.1:0`` prints ``http://127.0.0.1:<port>``, the
port the OS chose), where torchft's names the host, which need not resolve to the address bound. Only a wildcard
bind (``0.0.0.0``, ``::``) prints the host's name, as torchft does.

torchft's INFO lines (every quorum request and result, several per step) are off unless asked for:
``RUST_LOG=info`` or ``LIGHTNING_FT_TORCHFT_LOGS=1`` (lightning_ft/replica/torchft_console.py).
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import signal
import sys
import threading
from typing import Any

from lightning_ft.cli.errors import EXIT_OK, CLIError

__all__ = ["DEFAULT_BIND", "parse_bind", "register", "run_lighthouse"]

DEFAULT_BIND = "0.0.0.0:29510"
"""Every IPv4 interface, on torchft's lighthouse port: the groups of a job run on other hosts."""

_WILDCARDS = {"0.0.0.0", "::", ""}
_DEFAULTS_S = {"join_timeout_s": 1.0, "quorum_tick_s": 0.1, "heartbeat_timeout_s": 1.0}


def register(subparsers: Any) -> None:
    """Add the ``lighthouse`` subcommand to ``subparsers`` (from ``add_subparsers``)."""
    lighthouse = subparsers.add_parser(
        "lighthouse",
        help="run torchft's lighthouse for replica groups; prints TORCHFT_LIGHTHOUSE=http://HOST:PORT",
        epilog="exit codes: 0 stopped by SIGTERM or SIGINT; 2 a bad option, an address in use or not on this host,"
        " or torchft not installed. torchft's INFO lines are off: RUST_LOG=info turns them on",
    )
    lighthouse.add_argument(
        "--bind",
        default=DEFAULT_BIND,
        metavar="HOST:PORT",
        help=f"address to listen on (default {DEFAULT_BIND}: every IPv4 interface; [::]:PORT for IPv6 too; port 0:"
        " one the OS chooses)",
    )
    lighthouse.add_argument(
        "--min-replicas",
        type=int,
        required=True,
        metavar="N",
        help="fewest replica groups that make a quorum; with fewer live, the groups wait",
    )
    lighthouse.add_argument(
        "--join-timeout-s",
        type=float,
        default=_DEFAULTS_S["join_timeout_s"],
        metavar="S",
        help="how long a new quorum waits for groups that heartbeat but have not asked to join (default %(default)g;"
        " torchft's is 60)",
    )
    lighthouse.add_argument(
        "--quorum-tick-s",
        type=float,
        default=_DEFAULTS_S["quorum_tick_s"],
        metavar="S",
        help="how often the lighthouse checks whether a quorum is ready (default %(default)g)",
    )
    lighthouse.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=_DEFAULTS_S["heartbeat_timeout_s"],
        metavar="S",
        help="a group whose heartbeat is this late is dead and left out of the next quorum (default %(default)g;"
        " torchft's is 5)",
    )
    lighthouse.set_defaults(func=run_lighthouse)


def parse_bind(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` for an IPv6 address) as ``(host, port)``.

    Raises:
        CLIError: the value is not ``HOST:PORT`` with a port from 0 to 65535.
    """
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 address without brackets: the port cannot be told apart
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise CLIError(
            f"--bind={value}: must be HOST:PORT with a port from 0 to 65535 (0: the OS chooses), e.g. 127.0.0.1:0,"
            f" {DEFAULT_BIND} or [::1]:29510"
        )
    return host, int(port)


def _seconds_to_ms(option: str, value: float) -> int:
    if not (math.isfinite(value) and value > 0):
        raise CLIError(f"--{option}={value:g}: must be a positive, finite number of seconds")
    ms = round(value * 1000)
    if ms < 1:
        raise CLIError(f"--{option}={value:g}: must be at least 0.001 s (torchft counts whole milliseconds)")
    return ms


def _url(host: str, port: int, server_address: str) -> str:
    """The address clients use: the host bound, or for a wildcard bind the host's name as torchft gives it."""
    if host in _WILDCARDS:
        return server_address
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a host name
    return f"http://{host}:{port}"


def run_lighthouse(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; print ``TORCHFT_LIGHTHOUSE=<url>`` once the server listens. Returns 0.

    Runs in the main thread (it installs signal handlers); blocks until a signal arrives.

    Raises:
        CLIError: an option breaks its rule, the address is in use or not on this host, or torchft is missing.
    """
    if args.min_replicas < 1:
        raise CLIError(f"--min-replicas={args.min_replicas}: must be at least 1 (the fewest groups of a quorum)")
    host, port = parse_bind(args.bind)
    timeouts_ms = {
        name: _seconds_to_ms(name.replace("_", "-"), getattr(args, name)) for name in _DEFAULTS_S
    }  # join_timeout_s -> --join-timeout-s
    server_class = lighthouse_server_class()

    stop = threading.Event()
    # Installed before binding: a SIGTERM that arrives while the server starts still stops it cleanly.
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            server = server_class(
                bind=f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
                min_replicas=args.min_replicas,
                join_timeout_ms=timeouts_ms["join_timeout_s"],
                quorum_tick_ms=timeouts_ms["quorum_tick_s"],
                heartbeat_timeout_ms=timeouts_ms["heartbeat_timeout_s"],
            )
        except RuntimeError as error:
            raise CLIError(_bind_error(args.bind, error)) from None
        try:
            bound_port = int(server.address().rsplit(":", 1)[1])
            print(f"TORCHFT_LIGHTHOUSE={_url(host, bound_port, server.address())}", flush=True)
            while not stop.wait(0.5):  # a timed wait, so the signal handler runs promptly in the main thread
                pass
        finally:
            server.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("lightning-ft lighthouse: stopped", file=sys.stderr, flush=True)
    return EXIT_OK


def lighthouse_server_class() -> type:
    """torchft's ``LighthouseServer`` (what ``torchft.coordination`` exports), from its native module, without torch
    and with its Rust INFO lines off unless asked for (:mod:`lightning_ft._torchft_native`).

    Raises:
        CLIError: torchft is not installed (exit code 2).
    """
    from lightning_ft._torchft_native import import_torchft

    try:
        return import_torchft().LighthouseServer
    except ImportError:
        raise CLIError("lightning-ft lighthouse needs torchft: pip install 'lightning-ft[replicas]'") from None


def _bind_error(bind: str, error: RuntimeError) -> str:
    text = str(error)
    if "in use" in text.lower():
        return f"--bind={bind}: the address is already in use (another lighthouse?): choose another port or stop it"
    if "assign" in text.lower() or "lookup" in text.lower():
        return f"--bind={bind}: this host has no such address ({text}): bind one of its addresses, or 0.0.0.0"
    return f"--bind={bind}: could not start the lighthouse: {text}"
