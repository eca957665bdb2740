"""A real Slurm cluster on this one machine, on loopback: munged, slurmctld and one slurmd per node.

For the tests of `loom submit` and for trying it on a laptop. Everything (key, socket, config,
state, logs, pid files) lives in one folder; the system's munge and /etc/slurm are left alone.
Node i is named and addressed 127.0.0.i, so every node name resolves without /etc/hosts.

    python -m loom.tools.slurm_cluster up DIR [--nodes 1] [--cpus 8]   # then: source DIR/env.sh
    python -m loom.tools.slurm_cluster down DIR

Needs root and Debian's slurmctld, slurmd and munge (installed with apt-get when missing).
The cluster keeps no accounting database, so DIR/bin/sacct answers submitit's job-state queries
from slurmctld's own job table (squeue); finished jobs stay there for a day (MinJobAge).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from loom.errors import LoomError

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")

# Why the less obvious keys are there:
#  SlurmdParameters=config_overrides  a node may advertise more CPUs than the machine has
#  proctrack/linuxproc, task/none     no cgroup setup needed
#  MinJobAge=86400                    finished jobs stay visible to the sacct stand-in
#  KillWait=5                         scancel/requeue reach SIGKILL after 5 s, not 30
#  cred_expire=5                      a requeued job may start after 6 s instead of 121
#  sched_interval/bf_interval=1       nothing else wakes the scheduler when that time has passed
#  EnforcePartLimits=ALL              impossible requests fail at sbatch instead of pending forever
SLURM_CONF = """\
ClusterName=loom
SlurmctldHost=localhost
SlurmctldPort={port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.socket,cred_expire=5
StateSaveLocation={dir}/state
SlurmctldPidFile={dir}/slurmctld.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdSpoolDir={dir}/spool/%n
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmdLogFile={dir}/log/slurmd-%n.log
MailProg=/bin/true
EnforcePartLimits=ALL
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=86400
KillWait=5
SchedulerParameters=sched_interval=1,bf_interval=1
NodeName={names} NodeHostname=localhost NodeAddr={names} Port={ports} CPUs={cpus} Boards=1 SocketsPerBoard=1 \
CoresPerSocket={cpus} ThreadsPerCore=1 RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

# squeue shows transient states that sacct folds into a base state; submitit treats any state it
# does not know (CONFIGURING included) as finished, so they must be mapped.
SACCT_STATES = {
    "CONFIGURING": "RUNNING",
    "SIGNALING": "RUNNING",
    "STAGE_OUT": "RUNNING",
    "RESIZING": "RUNNING",
    "REQUEUE_HOLD": "PENDING",
    "REQUEUE_FED": "PENDING",
    "RESV_DEL_HOLD": "PENDING",
}
SQUEUE_FIELDS = {
    "jobid": "%i",
    "jobidraw": "%A",
    "jobname": "%j",
    "state": "%T",
    "nodelist": "%N",
    "partition": "%P",
    "user": "%u",
    "elapsed": "%M",
    "reason": "%r",
}


class ClusterError(LoomError):
    pass


def environment(folder: Path) -> dict[str, str]:
    """What a process needs to talk to the cluster (also written to DIR/env.sh)."""
    return {
        "SLURM_CONF": str(folder / "slurm.conf"),
        "PATH": f"{folder / 'bin'}:{os.environ.get('PATH', '')}",
        "GLOO_SOCKET_IFNAME": "lo",
    }


def install_packages() -> None:
    if all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.environ.get("LOOM_NO_APT"):
        raise ClusterError("Slurm is not installed and LOOM_NO_APT forbids installing it")
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise ClusterError("Slurm is not installed and cannot be (needs root and apt-get)")
    print(
        f"installing Debian packages {', '.join(PACKAGES)} with apt-get for a one-machine Slurm cluster "
        f"(set LOOM_NO_APT=1 to skip; the Slurm tests then skip)",
        file=sys.stderr,
        flush=True,
    )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
    ):
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise ClusterError(f"{' '.join(command)} failed: {result.stderr.strip()[-500:]}")


def _alive(pid_file: Path) -> bool:
    try:
        return _pid_running(int(pid_file.read_text()))
    except (OSError, ValueError):
        return False


def _idle_nodes(env: dict) -> int:
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True, timeout=5
        ).stdout
    except subprocess.TimeoutExpired:
        return 0
    return sum(line.strip() == "idle" for line in out.splitlines())


def up(folder: Path, nodes: int = 1, cpus: int = 8, port: int = 6817) -> dict[str, str]:
    """Start the daemons and wait until every node is idle; returns the environment to use."""
    install_packages()
    folder = folder.resolve()
    if _alive(folder / "slurmctld.pid"):
        raise ClusterError(f"a cluster is already running from {folder}")
    for sub in ("munge", "state", "spool", "log", "bin"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    for path in (folder, folder / "munge"):
        path.chmod(0o755)  # munged wants execute permission for all on its socket's folder
    sacct = folder / "bin" / "sacct"
    sacct.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} sacct "$@"\n')
    sacct.chmod(0o755)
    env = {**os.environ, **environment(folder)}
    try:
        key = folder / "munge" / "munge.key"
        if not key.exists():
            subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
        munge = folder / "munge"
        subprocess.run(
            [
                "/usr/sbin/munged",
                f"--key-file={key}",
                f"--socket={munge / 'munge.socket'}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={munge / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
            check=True,
            capture_output=True,
        )
        names = "127.0.0.1" if nodes == 1 else f"127.0.0.[1-{nodes}]"
        ports = str(port + 1) if nodes == 1 else f"[{port + 1}-{port + nodes}]"
        memory_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.8 / nodes)
        (folder / "slurm.conf").write_text(
            SLURM_CONF.format(dir=folder, port=port, names=names, ports=ports, cpus=cpus, memory_mb=memory_mb)
        )
        subprocess.run(["/usr/sbin/slurmctld"], env=env, check=True, capture_output=True)
        for i in range(1, nodes + 1):
            (folder / "spool" / f"127.0.0.{i}").mkdir(exist_ok=True)
            subprocess.run(["/usr/sbin/slurmd", "-N", f"127.0.0.{i}"], env=env, check=True, capture_output=True)
        exports = "".join(f"export {k}={v!r}\n" for k, v in environment(folder).items() if k != "PATH")
        (folder / "env.sh").write_text(f'{exports}export PATH={str(folder / "bin")!r}:"$PATH"\n')
        deadline = time.monotonic() + 30
        while _idle_nodes(env) < nodes:
            if time.monotonic() > deadline:
                logs = "; ".join(p.read_text()[-300:] for p in (folder / "log").glob("*.log"))
                raise ClusterError(f"the nodes did not become idle in 30 s; logs: {logs}")
            time.sleep(0.2)
    except subprocess.CalledProcessError as error:
        down(folder)
        logs = [folder / "munge" / "munged.log", *sorted((folder / "log").glob("*.log"))]
        tail = " | ".join(p.read_text().strip().splitlines()[-1] for p in logs if p.exists() and p.read_text())
        raise ClusterError(f"{Path(error.cmd[0]).name} failed to start: {tail or error}") from None
    except BaseException:
        down(folder)
        raise
    return environment(folder)


def _stop(pid_files: list[Path], grace_s: float = 20.0) -> None:
    pids = []
    for pid_file in pid_files:
        if _alive(pid_file):
            pids.append(int(pid_file.read_text()))
            os.kill(pids[-1], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _pid_running(pid)]
        time.sleep(0.1)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid_file in pid_files:
        pid_file.unlink(missing_ok=True)


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def down(folder: Path) -> None:
    """Cancel what is left, let the queue drain, then stop the daemons through their pid files."""
    folder = folder.resolve()
    env = {**os.environ, **environment(folder)}
    if _alive(folder / "slurmctld.pid"):
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True, timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True, timeout=10
            ).stdout
            if not out.strip():
                break
            time.sleep(0.2)
    # The slurmds and slurmctld still need munged while they shut down.
    _stop(sorted(folder.glob("slurmd-*.pid")) + [folder / "slurmctld.pid"])
    _stop([folder / "munge" / "munged.pid"])


def sacct(argv: list[str]) -> int:
    """The `sacct --parsable2` answer submitit reads (`-o JobID,State,NodeList -j ID ...`), from squeue."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("-o", "--format", default="JobID,JobName,Partition,State,NodeList")
    parser.add_argument("-j", "--jobs", action="append", default=[])
    parser.add_argument("-n", "--noheader", action="store_true")
    args, _ = parser.parse_known_args(argv)
    fields = [f.split("%")[0] for f in args.format.split(",")]
    wanted = {j for spec in args.jobs for j in spec.split(",") if j}
    codes = ["%i", "%A"] + [SQUEUE_FIELDS.get(f.lower(), "%i") for f in fields]
    separator = "\x1f"
    out = subprocess.run(
        ["squeue", "-h", "-r", "-t", "all", "-o", separator.join(codes)], capture_output=True, text=True
    ).stdout
    if not args.noheader:
        print("|".join(fields))
    for line in out.splitlines():
        job_id, raw_id, *values = line.split(separator)
        if wanted and job_id not in wanted and raw_id not in wanted:
            continue
        for i, field in enumerate(fields):
            if field.lower() == "state":
                values[i] = SACCT_STATES.get(values[i], values[i])
            elif field.lower() == "nodelist" and not values[i]:
                values[i] = "None assigned"
        print("|".join(values))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sacct"]:
        return sacct(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m loom.tools.slurm_cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--cpus", type=int, default=8, help="CPUs each node advertises (may exceed the real ones)")
    parser.add_argument("--port", type=int, default=6817, help="slurmctld's port; the slurmds use the next ones")
    args = parser.parse_args(argv)
    try:
        if args.action == "up":
            start = time.monotonic()
            up(args.folder, args.nodes, args.cpus, args.port)
            print(
                f"slurm up ({args.nodes} node(s)) in {time.monotonic() - start:.1f} s; "
                f"now: source {args.folder.resolve() / 'env.sh'}"
            )
        else:
            down(args.folder)
            print(f"slurm down ({args.folder})")
    except (ClusterError, subprocess.CalledProcessError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
