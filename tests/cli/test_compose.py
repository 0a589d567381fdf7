"""The docker-compose demo and the Dockerfile, checked without a Docker engine: structure, every
command against the real CLIs, the egress-shaping entrypoint (with a recording ``tc`` and, as
root, the real one in a network namespace) and the DDP-vs-DiLoCo report. The real run with an
engine is ``test_compose_e2e.py``."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
IMAGE_ROOT = "/opt/lowband"  # WORKDIR of the Dockerfile
COMPOSE_TEXT = (REPO / "docker-compose.yml").read_text()
COMPOSE = yaml.safe_load(COMPOSE_TEXT)
SERVICES = COMPOSE["services"]
DOCKERFILE = (REPO / "Dockerfile").read_text()
SHAPE = REPO / "docker" / "shape-egress.sh"


def defaults(text: str) -> str:
    """``${VAR:-default}`` as Compose expands it with VAR unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)


def commands(service: dict) -> list[list[str]]:
    """The argv lists a service runs (``sh -c "a && b"`` is split into a and b), with every
    ``${VAR:-default}`` at its default."""
    cmd = service.get("command")
    if cmd is None:
        return []
    if isinstance(cmd, str):
        cmd = shlex.split(cmd)
    cmd = [defaults(a) for a in cmd]
    if cmd[:2] == ["sh", "-c"]:
        return [shlex.split(part) for part in cmd[2].split("&&")]
    return [list(cmd)]


RUNS_MOUNT = "${RUNS:-./runs}:/runs"  # results land in a host directory the script reads


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def sites() -> dict[str, dict]:
    return {
        n: s
        for n, s in SERVICES.items()
        if any(c[:2] == ["lowband", "worker"] for c in commands(s))
    }


def in_repo(path: str) -> Path:
    """A path inside the image mapped onto this checkout."""
    assert path.startswith(IMAGE_ROOT + "/"), path
    return REPO / path[len(IMAGE_ROOT) + 1 :]


# ---- services ----------------------------------------------------------------------------------
def test_every_service_uses_the_image_built_here():
    for name, svc in SERVICES.items():
        assert svc["image"] == "lowband:latest", name
        assert svc["build"]["context"] == "." and svc["build"]["dockerfile"] == "Dockerfile"


def test_three_shaped_sites_train_diloco_then_ddp_against_the_coordinators():
    coordinators = {}
    for name, svc in SERVICES.items():
        for argv in commands(svc):
            if argv[:2] == ["lowband", "coordinator"]:
                port = flag(argv, "--bind").rsplit(":", 1)[1]
                assert port in svc["expose"], name
                coordinators[name] = port
    found = sites()
    assert len(found) >= 3
    cfg_sites = set()
    for name, svc in found.items():
        assert "NET_ADMIN" in svc["cap_add"], name
        env = svc["environment"]
        assert re.fullmatch(r"\$\{RATE:-\d+[kmg]?bit\}", env["RATE"]), env
        assert re.fullmatch(r"\$\{DELAY:-\d+ms\}", env["DELAY"]), env
        assert RUNS_MOUNT in svc["volumes"]
        runs = commands(svc)
        assert [("--mode" in a and flag(a, "--mode")) or "diloco" for a in runs] == [
            "diloco",
            "ddp",
        ]
        outs = set()
        for argv in runs:
            host, port = flag(argv, "--coordinator").removeprefix("tcp://").rsplit(":", 1)
            assert coordinators[host] == port
            assert svc["depends_on"][host] == {"condition": "service_healthy"}
            assert flag(argv, "--id") == name == svc["hostname"] == flag(argv, "--advertise-host")
            outs.add(flag(argv, "--out"))
            cfg_sites.add(flag(argv, "--config"))
        assert outs == {"/runs/diloco", "/runs/ddp"}
    # one config for every worker of both runs, waiting for as many workers as there are sites
    from diloco.config import DilocoConfig, config_from_dict

    (cfg_path,) = cfg_sites
    cfg = config_from_dict(json.loads(in_repo(cfg_path).read_text()))
    assert cfg.workers == len(found) and isinstance(cfg.mode, DilocoConfig)
    assert re.search(
        rf"^COPY .*{re.escape(cfg_path.rsplit('/', 1)[1])} docker/$", DOCKERFILE, flags=re.M
    )


def test_report_runs_after_every_site_and_reads_both_runs():
    rep = SERVICES["report"]
    assert rep["depends_on"] == {
        n: {"condition": "service_completed_successfully"} for n in sites()
    }
    (argv,) = commands(rep)
    assert argv[:2] == ["python", f"{IMAGE_ROOT}/docker/compare.py"]
    assert in_repo(argv[1]).exists()
    assert (flag(argv, "--diloco"), flag(argv, "--ddp")) == ("/runs/diloco", "/runs/ddp")
    assert RUNS_MOUNT in rep["volumes"] and "--json" in argv


def test_one_file_for_compose_v1_and_v2():
    # docker-compose 1.29 rejects `name:`; v2 warns about `version:`; both take the rest
    assert set(COMPOSE) == {"services"} | {k for k in COMPOSE if k.startswith("x-")}
    for name, svc in SERVICES.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on without conditions"
        for dep, cond in deps.items():
            assert cond["condition"] in (
                "service_healthy",
                "service_started",
                "service_completed_successfully",
            ), (name, dep)
            if cond["condition"] == "service_healthy":
                assert SERVICES[dep]["healthcheck"]["test"][0] == "CMD", dep
        assert not any("sleep" in a for argv in commands(svc) for a in argv), name


def test_flower_profile_is_a_shaped_federation():
    flower = {n: s for n, s in SERVICES.items() if "flower" in s.get("profiles", [])}
    assert not any("flower" in s.get("profiles", []) for s in sites().values())
    (link,) = [commands(s)[0] for s in flower.values() if commands(s)[0][0] == "flower-superlink"]
    port = flag(link, "--port")
    assert flag(link, "--host") == "0.0.0.0" and "--insecure" in link
    assert "--disable-runtime-dependency-installation" in link  # the image has the deps
    nodes = {n: s for n, s in flower.items() if commands(s)[0][0] == "flower-supernode"}
    assert len(nodes) >= 2
    partitions = []
    for name, svc in nodes.items():
        argv = commands(svc)[0]
        assert flag(argv, "--superlink") == f"superlink:{port}" and "NET_ADMIN" in svc["cap_add"]
        cfg = dict(kv.split("=") for kv in flag(argv, "--node-config").split())
        assert int(cfg["num-partitions"]) == len(nodes)
        partitions.append(int(cfg["partition-id"]))
    assert sorted(partitions) == list(range(len(nodes)))
    (job,) = [
        commands(s)[0]
        for s in flower.values()
        if commands(s)[0][:3] == ["lowband", "flower", "run"]
    ]
    assert flag(job, "--superlink") == f"superlink:{port}"
    settings = dict(job[i + 1].split("=", 1) for i, a in enumerate(job) if a == "--set")
    assert int(settings["min-available-nodes"]) == len(nodes)
    # the ServerApp runs inside the SuperLink container: its out-dir must be on the volume
    assert (
        flag(job, "--out").startswith("/runs/") and RUNS_MOUNT in SERVICES["superlink"]["volumes"]
    )


def test_the_insecure_lab_stays_on_the_private_compose_network():
    """Every process here runs without authentication or TLS (--insecure): that is only honest
    while nothing is reachable from beyond this host. No service publishes a port or shares the
    host's network, and the header comment says so."""
    insecure = [n for n, s in SERVICES.items() for a in commands(s) if "--insecure" in a]
    assert {"coordinator", "superlink", "supernode-1", "flower-run"} <= set(insecure)
    for name, svc in SERVICES.items():
        assert "ports" not in svc, f"{name} publishes {svc['ports']}"
        assert svc.get("network_mode") is None and "networks" not in svc, name
    head = COMPOSE_TEXT.split("services:", 1)[0]
    assert "no service publishes a port" in head and "without TLS" in head


# ---- every command against the real command lines -------------------------------------------
LOWBAND_COMMANDS = [(n, a) for n, s in SERVICES.items() for a in commands(s) if a[0] == "lowband"]


@pytest.mark.parametrize(
    "service,argv", LOWBAND_COMMANDS, ids=[f"{n}:{' '.join(a[:2])}" for n, a in LOWBAND_COMMANDS]
)
def test_lowband_commands_are_accepted_by_the_cli(service, argv):
    from cli import build_parser

    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse has no API
    if argv[1] not in subcommands:
        pytest.fail(f"{service}: `lowband {argv[1]}` is not a lowband command")
    try:
        args = parser.parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"{service}: `{shlex.join(argv)}` rejected by the CLI (exit {exc.code})")
    if argv[1:3] == ["flower", "run"]:
        from cli.flower import submit_config

        submit_config(args)  # every --set value validated like the app will


def test_flower_commands_are_accepted_by_the_installed_flower():
    import flwr  # noqa: F401 - required (the dev extra)

    # Flower builds these parsers in private functions; if a release renames them, fall back to
    # checking each flag against `--help` (slower: a process per executable).
    parsers = {}
    try:
        from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink
        from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

        parsers = {
            "flower-superlink": _parse_args_run_superlink,
            "flower-supernode": _parse_args_run_supernode,
        }
    except ImportError:
        pass
    seen = set()
    for name, svc in SERVICES.items():
        for argv in commands(svc):
            if not argv[0].startswith("flower-"):
                continue
            seen.add(argv[0])
            if argv[0] in parsers:
                try:
                    parsers[argv[0]]().parse_args(argv[1:])
                except SystemExit as exc:
                    pytest.fail(f"{name}: `{shlex.join(argv)}` rejected (exit {exc.code})")
                continue
            exe = Path(sys.executable).parent / argv[0]
            text = subprocess.run(
                [str(exe), "--help"], capture_output=True, text=True, timeout=120
            ).stdout
            for f in (a for a in argv if a.startswith("--")):
                assert re.search(rf"(^|[\s\[,]){re.escape(f)}\b", text), f"{argv[0]} has no {f}"
    assert seen == {"flower-superlink", "flower-supernode"}


# ---- Dockerfile and .dockerignore --------------------------------------------------------------
def test_dockerfile_installs_cpu_torch_the_package_and_the_entrypoint():
    pinned = (REPO / "constraints.txt").read_text()
    (version,) = re.findall(r"^torch==([\w.]+)$", pinned, flags=re.M)
    # users get the PyTorch CPU index; a local wheel directory (build argument) is tried first
    assert re.search(
        r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cpu$", DOCKERFILE, flags=re.M
    )
    assert re.search(r"^ARG BASE=python:3\.11-slim$", DOCKERFILE, flags=re.M)
    assert f'pip install torch=={version} --index-url "$TORCH_INDEX"' in DOCKERFILE
    assert f"pip install --no-index --find-links /wheels torch=={version}" in DOCKERFILE
    assert "--mount=type=secret,id=ca" in DOCKERFILE  # the CA bundle never lands in a layer
    # the CPU torch comes first, so the constrained installs find it satisfied
    assert DOCKERFILE.index("$TORCH_INDEX") < DOCKERFILE.index("-c constraints.txt -r")
    assert DOCKERFILE.index("-c constraints.txt -r") < DOCKERFILE.index("COPY lowband/")
    assert (
        'pip install --no-deps --no-build-isolation --no-index -c constraints.txt ".[train,flower]"'
        in DOCKERFILE
    )
    copied = set(re.findall(r"^COPY (\S+)/ \1/$", DOCKERFILE, flags=re.M))
    docker_files = re.search(r"^COPY ((?:docker/\S+ )+)docker/$", DOCKERFILE, flags=re.M)
    assert docker_files and all((REPO / f).is_file() for f in docker_files.group(1).split())
    tomllib = __import__("tomllib" if sys.version_info >= (3, 11) else "tomli")
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]["find"]["include"]
    assert {p.rstrip("*") for p in packages} <= copied
    assert "examples" in copied
    m = re.search(r"^ENTRYPOINT \[\"(.+?)\"\]$", DOCKERFILE, flags=re.M)
    assert m and m.group(1) == f"{IMAGE_ROOT}/docker/shape-egress.sh"
    assert re.search(rf"^WORKDIR {IMAGE_ROOT}$", DOCKERFILE, flags=re.M)
    assert "iproute2" in DOCKERFILE  # tc
    ignored = {
        l.strip()
        for l in (REPO / ".dockerignore").read_text().splitlines()
        if l.strip() and not l.startswith("#")
    }
    assert {".git", "tests", "**/__pycache__"} <= ignored
    assert not ignored & (copied | {"pyproject.toml", "README.md", "LICENSE", "constraints.txt"})


# ---- the egress-shaping entrypoint -----------------------------------------------------------
@pytest.fixture
def fake_tc(tmp_path):
    """A `tc` that records its arguments; netem 'exists' unless NETEM=0."""
    log = tmp_path / "tc.log"
    tc = tmp_path / "tc"
    tc.write_text(
        f'#!/bin/sh\necho "$*" >> {log}\n'
        'case "$*" in *netem*) [ "${NETEM:-1}" = 1 ] || exit 2;; esac\n'
    )
    tc.chmod(0o755)
    return tc, log


def shape(tc: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sh", str(SHAPE), "echo", "ran", "the", "command"],
        env={"PATH": os.environ["PATH"], "TC": str(tc), **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_entrypoint_adds_netem_delay_under_tbf_when_the_kernel_has_netem(fake_tc):
    tc, log = fake_tc
    r = shape(tc, RATE="50mbit", DELAY="40ms")
    assert r.returncode == 0 and r.stdout == "ran the command\n"
    assert log.read_text().splitlines() == [
        "qdisc replace dev eth0 root handle 1: netem delay 40ms",
        "qdisc replace dev eth0 parent 1:1 handle 10: tbf rate 50mbit burst 64kb latency 50ms",
    ]


def test_entrypoint_falls_back_to_tbf_alone_without_netem(fake_tc):
    tc, log = fake_tc
    r = shape(tc, RATE="20mbit", DELAY="80ms", NETEM="0", IFACE="eth1")
    assert r.returncode == 0 and r.stdout == "ran the command\n"
    assert "netem is not available" in r.stderr
    assert (
        log.read_text().splitlines()[-1]
        == "qdisc replace dev eth1 root tbf rate 20mbit burst 64kb latency 50ms"
    )


def test_entrypoint_without_settings_only_runs_the_command(fake_tc):
    tc, log = fake_tc
    r = shape(tc)
    assert r.returncode == 0 and r.stdout == "ran the command\n" and not log.exists()


def test_dockerfile_creates_a_user_and_the_entrypoint_drops_root_after_tc():
    # the image: an unprivileged user, named to the entrypoint, created before it is used
    m = re.search(
        r"^RUN groupadd .*\n(?:.*\\\n)*?.*useradd .*--uid (\d+).* lowband", DOCKERFILE, re.M
    )
    assert m and int(m.group(1)) >= 1000, "the Dockerfile creates no unprivileged user"
    assert re.search(r"^ENV LOWBAND_USER=lowband", DOCKERFILE, flags=re.M)
    assert DOCKERFILE.index("useradd") < DOCKERFILE.index("ENTRYPOINT")
    assert not re.search(r"^USER root", DOCKERFILE, flags=re.M)
    # the script: every tc call, then setpriv, and the command only after it (or without a user)
    lines = SHAPE.read_text().splitlines()
    code = [(i, l.strip()) for i, l in enumerate(lines) if l.strip() and not l.startswith("#")]
    tc = [i for i, l in code if l.startswith('"$TC"') or 'if "$TC"' in l]
    (drop,) = [i for i, l in code if "exec setpriv" in l]
    execs = [i for i, l in code if l.startswith("exec ") or " exec " in l]
    assert tc and max(tc) < drop and execs[-1] > drop and execs[:-1] == [drop]
    for opt in ("--reuid=", "--regid=", "--no-new-privs"):
        assert opt in lines[drop]


def _as_root_dropping(tc: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    if os.geteuid() != 0:
        pytest.skip("dropping privileges needs root")
    return subprocess.run(
        ["sh", str(SHAPE), "sh", "-c", 'id -u; id -g; id -G; echo "$HOME"'],
        env={"PATH": os.environ["PATH"], "TC": str(tc), "RATE": "10mbit", **env},
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )


def test_entrypoint_runs_tc_as_root_and_the_command_as_the_user(fake_tc, tmp_path):
    tc, log = fake_tc
    tc.write_text(tc.read_text() + f"id -u >> {log}.uid\n")
    r = _as_root_dropping(tc, tmp_path, LOWBAND_USER="nobody")
    assert r.returncode == 0, r.stderr
    nobody = subprocess.run(["id", "-u", "nobody"], capture_output=True, text=True).stdout
    uid, gid, groups, home = r.stdout.splitlines()
    assert uid == nobody.strip() != "0" and gid != "0" and "0" not in groups.split()
    assert Path(f"{log}.uid").read_text() == "0\n"  # tc itself ran as root
    # a user that does not exist: the command does not run at all (never as root)
    r = _as_root_dropping(tc, tmp_path, LOWBAND_USER="no-such-user-lb")
    assert r.returncode != 0 and r.stdout == ""


def test_entrypoint_writes_results_as_the_owner_of_the_data_dir(fake_tc, tmp_path):
    tc, _ = fake_tc
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "old.json").write_text("{}")
    # a mount point Docker created (root's): handed to the user, then the command runs as it
    r = _as_root_dropping(tc, tmp_path, LOWBAND_USER="nobody", LOWBAND_DATA=str(runs))
    assert r.returncode == 0, r.stderr
    uid = int(r.stdout.splitlines()[0])
    assert uid != 0 and runs.stat().st_uid == uid and (runs / "old.json").stat().st_uid == uid
    # a host user's directory: the command runs as that uid:gid, with no other groups
    os.chown(runs, 12345, 12346)
    r = _as_root_dropping(tc, tmp_path, LOWBAND_USER="nobody", LOWBAND_DATA=str(runs))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[:3] == ["12345", "12346", "12346"]


@pytest.mark.netns
def test_entrypoint_shapes_a_real_interface(tmp_path):
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs root and iproute2")
    ns = f"lbcompose{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
    try:

        def run(*argv: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                ["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=30
            )

        assert run("ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1").returncode == 0
        assert run("ip", "link", "set", "v0", "up").returncode == 0
        r = run("env", "IFACE=v0", "RATE=10mbit", "sh", str(SHAPE), "echo", "ok")
        assert r.returncode == 0 and r.stdout == "ok\n", r.stderr
        qdisc = run("tc", "qdisc", "show", "dev", "v0").stdout
        assert re.search(r"qdisc tbf \S+ root .*rate 10Mbit", qdisc), qdisc
    finally:
        subprocess.run(["ip", "netns", "del", ns], timeout=30)


# ---- the report ------------------------------------------------------------------------------
def write_run(directory: Path, mode: str, bytes_sent: int, losses: list[float]) -> None:
    directory.mkdir(parents=True)
    for i in range(3):
        recs = (
            [
                {"event": "eval", "step": 10 * (k + 1), "loss": l, "bytes_sent": bytes_sent * k}
                for k, l in enumerate(losses)
            ]
            if i == 0
            else []
        )
        recs.append(
            {
                "event": "final",
                "mode": mode,
                "final_eval": losses[-1] if i == 0 else None,
                "bytes_sent": bytes_sent,
                "peak_sync_bytes": bytes_sent // 10,
                "wall_s": 10.0 + i,
                "sync_s": 2.0,
                "tokens": 1000,
            }
        )
        (directory / f"metrics-site-{i}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in recs)
        )


def test_report_compares_the_two_runs(tmp_path):
    write_run(tmp_path / "diloco", "diloco", 1_000_000, [3.0, 2.5, 2.2])
    write_run(tmp_path / "ddp", "ddp", 400_000_000, [3.0, 2.4, 2.0])
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "docker" / "compare.py"),
            "--diloco",
            str(tmp_path / "diloco"),
            "--ddp",
            str(tmp_path / "ddp"),
            "--plot",
            str(tmp_path / "plot.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.splitlines()[-1])
    assert result["bytes_ratio"] == pytest.approx(400.0)
    assert result["loss_gap"] == pytest.approx(0.1)
    assert result["runs"]["DDP"]["workers"] == 3 and result["runs"]["DDP"]["wall_s"] == 12.0
    assert "400x fewer bytes" in r.stdout and (tmp_path / "plot.png").stat().st_size > 0
    missing = subprocess.run(
        [
            sys.executable,
            str(REPO / "docker" / "compare.py"),
            "--diloco",
            str(tmp_path / "nope"),
            "--ddp",
            str(tmp_path / "ddp"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert missing.returncode == 1 and "no finished worker" in missing.stderr
