"""`pdserve doctor`: what the KV transport can use on this machine.

Reports the UCX the native extension runs with (version, libucp path, what it was built against),
the transports UCX sees (ucp_context_print_info of a fresh context: a transport on a device per
line, after any UCX_* configuration), the UCX modules installed beside that libucp, whether RDMA
(verbs rc/dc/ud, mlx5, EFA srd) and CUDA memory are usable, and whether the same-host path
(process_vm_readv) is allowed: Yama ptrace scope, pid namespace, and a live probe against a
child process. `--build DIR` checks another build of the extension; `--json` prints the same as
one JSON object. Exit status 1 when the extension cannot be loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RDMA_TRANSPORTS = ("rc_verbs", "rc_mlx5", "dc_mlx5", "ud_verbs", "ud_mlx5", "rc", "dc", "ud",
                   "srd", "gga")
_RESOURCE = re.compile(r"resource\s+\d+\s*:.*--\s*(\S+)/(\S+)")

_PROBE_CHILD = """
import sys
from kernels import native
if len(sys.argv) > 1:
    native.select(sys.argv[1])
from kvtransfer.transport import UcxEngine
e = UcxEngine(name="doctor-probe")
sys.stdout.write(e.address.hex() + " " + e.locality.hex() + "\\n")
sys.stdout.flush()
sys.stdin.readline()
e.close()
"""


@dataclass
class Report:
    """Everything `pdserve doctor` found."""

    ucx_version: str = ""
    libucp: str = ""
    built_against: str = ""
    header_api: str = ""
    build_note: str = ""
    transports: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    memory_types: list[str] = field(default_factory=list)
    rdma: str = ""
    cuda_memory: str = ""
    ptrace_scope: str = ""
    pid_namespace: str = ""
    same_host: str = ""
    error: str = ""


def transports_of(context_info: str) -> list[str]:
    """`transport/device` for every resource line of ucp_context_print_info."""
    return [f"{tl}/{dev}" for tl, dev in _RESOURCE.findall(context_info)]


def modules_beside(libucp: str) -> list[str]:
    """UCX transport modules installed next to a libucp (its `ucx/` directory)."""
    moddir = Path(libucp).parent / "ucx"
    names = {m.group(1) for p in moddir.glob("lib*.so*")
             if (m := re.match(r"lib(uct_\w+|ucm_\w+)\.so", p.name))}
    return sorted(names)


def rdma_verdict(transports: list[str], modules: list[str]) -> str:
    """Whether RDMA lanes are usable, and why not."""
    found = sorted({t for t in transports if t.split("/")[0] in RDMA_TRANSPORTS})
    if found:
        return "yes: " + ", ".join(found)
    verbs = [m for m in modules if m.startswith("uct_ib")]
    if verbs:
        return (f"no: this UCX has verbs modules ({', '.join(verbs)}) but sees no RDMA device "
                "(no InfiniBand/RoCE HCA or EFA, or no libibverbs provider)")
    return ("no: this UCX has no verbs modules (libuct_ib*); build against NIXL's UCX "
            "(python -m kernels.native.build --ucx nixl) or a system UCX with verbs")


def cuda_verdict(memory_types: list[str], modules: list[str]) -> str:
    """Whether UCX can register CUDA memory, and why not."""
    if "cuda" in memory_types:
        return ("yes (pdserve's pull between two processes on one GPU ran in bench/gpu_check.sh; "
                "no GPU in its CI)")
    if "uct_cuda" in modules:
        return "no: the cuda module is installed but found no GPU / CUDA driver"
    return "no: this UCX has no cuda module"


def ptrace_scope() -> str:
    """Yama's ptrace scope and what it means for same-host reads."""
    try:
        value = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    except OSError:
        return "no Yama (only uid and dumpable checks apply)"
    meaning = {"0": "classic: same uid may read", "1": "restricted: engines allow same-uid "
               "readers with prctl(PR_SET_PTRACER_ANY)", "2": "admin-only: needs CAP_SYS_PTRACE",
               "3": "no attach: same-host reads impossible"}
    return f"{value} ({meaning.get(value, 'unknown')})"


def pid_namespace() -> str:
    """Our pid namespace, and whether it is the host's (pid 1's) one."""
    try:
        ours = os.readlink("/proc/self/ns/pid")
    except OSError as exc:
        return f"unknown ({exc})"
    try:
        init = os.readlink("/proc/1/ns/pid")
    except OSError:
        return f"{ours} (pid 1's namespace unreadable)"
    where = "the host's" if ours == init else "not the host's (a container?)"
    return f"{ours}, {where}: same-host reads need peers in this pid namespace"


def same_host_probe(build_dir: Path | None = None, timeout_s: float = 60.0) -> str:
    """Start a child engine and connect with its locality: the path a same-host peer gets."""
    from kvtransfer.transport import UcxEngine

    argv = [sys.executable, "-c", _PROBE_CHILD, *([str(build_dir)] if build_dir else [])]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline().split()
        if not line:
            return "unknown: the probe process did not start"
        address = bytes.fromhex(line[0])
        locality = bytes.fromhex(line[1]) if len(line) > 1 else b""
        if not locality:
            return "no: the same-host path is off in this configuration"
        with UcxEngine(name="doctor") as engine:
            peer = engine.connect(address, locality)
            verdict = ("yes (process_vm_readv probe of a child engine succeeded)"
                       if peer.path == "pvm" else f"no: {peer.path_reason}")
            peer.abort()
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout_s)
        return verdict
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def diagnose(probe: bool = True, build_dir: Path | None = None) -> Report:
    """Gather the report (loads the extension and creates one UCX context)."""
    from kernels import native
    from kvtransfer.transport import TransportError, UcxEngine

    report = Report(ptrace_scope=ptrace_scope(), pid_namespace=pid_namespace())
    try:
        info = native.runtime_info()
        engine = UcxEngine(name="doctor")
    except (native.NativeUnavailable, TransportError) as exc:
        report.error = str(exc)
        return report
    with engine:
        report.transports = transports_of(engine.context_info())
        report.memory_types = engine.memory_types
    record = info.get("build") or {}
    report.ucx_version = info["ucx_version"]
    report.libucp = info["libucp"]
    report.built_against = info["ucx_source"]
    report.header_api = info["header_api"]
    report.build_note = str(record.get("note", ""))
    report.modules = modules_beside(report.libucp)
    report.rdma = rdma_verdict(report.transports, report.modules)
    report.cuda_memory = cuda_verdict(report.memory_types, report.modules)
    report.same_host = same_host_probe(build_dir) if probe else "not probed"
    return report


def render(report: Report) -> str:
    """The human-readable report."""
    if report.error:
        return f"UCX extension: unavailable: {report.error}\n"
    lines = [
        f"UCX version      {report.ucx_version}",
        f"libucp           {report.libucp}",
        f"built against    {report.built_against} (UCP API {report.header_api} headers)",
    ]
    if report.build_note:
        lines.append(f"                 {report.build_note}")
    lines += [
        f"transports       {', '.join(report.transports) or '(none)'}",
        f"modules          {', '.join(report.modules) or '(none)'}",
        f"memory types     {', '.join(report.memory_types)}",
        f"RDMA             {report.rdma}",
        f"CUDA memory      {report.cuda_memory}",
        f"ptrace scope     {report.ptrace_scope}",
        f"pid namespace    {report.pid_namespace}",
        f"same-host reads  {report.same_host}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`pdserve doctor [--json] [--no-probe]`."""
    parser = argparse.ArgumentParser(prog="pdserve doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.add_argument("--no-probe", action="store_true",
                        help="skip the same-host probe (it starts one child process)")
    parser.add_argument("--build", type=Path,
                        help="check a build of the extension in this directory (python -m "
                             "kernels.native.build --out DIR) instead of the installed one")
    args = parser.parse_args(argv)
    if args.build is not None:
        from kernels import native

        native.select(args.build)
    report = diagnose(probe=not args.no_probe, build_dir=args.build)
    out: Any = asdict(report)
    sys.stdout.write(json.dumps(out, indent=2) + "\n" if args.json else render(report))
    return 1 if report.error else 0


if __name__ == "__main__":
    sys.exit(main())
