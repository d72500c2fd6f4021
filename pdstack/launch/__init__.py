"""``pdstack launch``: run one node's planned services as plain processes.

The pieces, from the command line down (the user's description is :mod:`.cli`'s):

- :mod:`.cli`: the subcommand's flags, picking the node and services, start/stop/status;
- :mod:`.launcher`: :class:`Launcher`, starting stage by stage, status, the foreground stay;
- :mod:`.supervise`: the foreground supervisor (restart what dies or wedges, with backoff);
- :mod:`.services`: a node's services as process groups: find, spawn, signal, stop;
- :mod:`.health`: health checks, waiting for a stage to be healthy, log tails;
- :mod:`.procs`: /proc reading, pid files, starting and signalling one process group;
- :mod:`.prepare`: each service's argv and environment, the secrets file, ``--env``.
"""

from __future__ import annotations

from pdstack.launch.cli import (
    BACKENDS_IN_COMPOSE,
    cmd_launch,
    default_log_dir,
    pick_node,
    print_status,
    register,
)
from pdstack.launch.health import TAIL_LINES, check_health, tail, wait_healthy
from pdstack.launch.launcher import STAGES, Launcher
from pdstack.launch.prepare import (
    Prepared,
    parse_overrides,
    prepare,
    read_env_file,
    resolve_argv,
    service_env,
)
from pdstack.launch.procs import PidRecord, _alive, _proc_stat, group_members
from pdstack.launch.services import EXIT_FAILED, EXIT_INVALID, EXIT_OK, Services
from pdstack.launch.supervise import (
    RESTART_BACKOFF_S,
    RESTART_POLICIES,
    WATCHDOG_CHECK_TIMEOUT_S,
    Supervisor,
    _Supervised,
)

__all__ = [
    "BACKENDS_IN_COMPOSE",
    "EXIT_FAILED",
    "EXIT_INVALID",
    "EXIT_OK",
    "RESTART_BACKOFF_S",
    "RESTART_POLICIES",
    "STAGES",
    "TAIL_LINES",
    "WATCHDOG_CHECK_TIMEOUT_S",
    "Launcher",
    "PidRecord",
    "Prepared",
    "Services",
    "Supervisor",
    "_Supervised",
    "_alive",
    "_proc_stat",
    "check_health",
    "cmd_launch",
    "default_log_dir",
    "group_members",
    "parse_overrides",
    "pick_node",
    "prepare",
    "print_status",
    "read_env_file",
    "register",
    "resolve_argv",
    "service_env",
    "tail",
    "wait_healthy",
]
