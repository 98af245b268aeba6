"""The deploy kit (deploy/kit/, docs/edge-guide.md), validated as far as this machine allows.

There is no Docker engine here, so images are not built: the compose files are parsed and every
service's command is parsed by the real ``graphfl`` command line (click's parser: unknown
options, bad types and missing required options are errors), the Dockerfiles' ARGs, ENTRYPOINT and
build-args are cross-checked. The systemd units' ExecStart lines are expanded as systemd would
(EnvironmentFile, ``%i``) and parsed the same way; the SuperLink/SuperNode command lines they
exec are checked against ``flower-superlink --help`` / ``flower-supernode --help``; the peer start
script is run for real. ``systemd-analyze verify`` runs where it is installed. ``graphfl certs``
is run in-process and its output checked with ``cryptography``.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import click
import pytest
import typer
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from typer.testing import CliRunner

import graphfl.deploy
from graphfl.cli import app

KIT = Path(graphfl.deploy.__file__).parent / "kit"
ROOT = KIT.parent.parent  # the package root (= repository root in a checkout)
UNITS = ("graphfl-superlink.service", "graphfl-supernode@.service", "graphfl-peer@.service")
GRAPHFL_BIN = "/opt/graphfl/venv/bin/graphfl"


# ----------------------------------------------------------------------------- helpers

def parse_cli(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """Parse ``graphfl ARGV`` with the real CLI without running it: ``(command, params)``.

    Raises click's UsageError (unknown option, bad value, missing required option...).
    """
    group = typer.main.get_command(app)
    assert isinstance(group, click.Group)
    ctx = click.Context(group, info_name="graphfl")
    name, cmd, sub_args = group.resolve_command(ctx, list(argv))  # UsageError for an unknown command
    assert name is not None and cmd is not None
    with cmd.make_context(name, sub_args, parent=ctx) as sub:
        return name, dict(sub.params)


def long_options(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--") and a != "--"]


def interpolate(value: Any) -> Any:
    """Compose's ``${VAR:-default}`` with the variables unset (their defaults)."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m.group(1), m.group(2)), value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def merge(base: Any, override: Any) -> Any:
    """Compose's merge of ``-f a.yaml -f b.yaml``: mappings merge, other values (command lists) replace."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = merge(base[k], v) if k in base else v
        return out
    return override


def load_compose(*names: str) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for name in names:
        doc = merge(doc, yaml.safe_load((KIT / name).read_text()))
    return interpolate(doc)


def dockerfile(name: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile (continuations joined, comments dropped)."""
    lines: list[tuple[str, str]] = []
    buf = ""
    for raw in (KIT / name).read_text().splitlines():
        if not buf and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        buf += raw.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        word, _, rest = buf.strip().partition(" ")
        lines.append((word.upper(), rest.strip()))
        buf = ""
    return lines


def docker_args(name: str) -> dict[str, str]:
    out = {}
    for ins, rest in dockerfile(name):
        if ins == "ARG":
            key, _, default = rest.partition("=")
            out[key] = default
    return out


def unit(name: str) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as ``{section: [(key, value), ...]}`` (repeated keys kept in order)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in (KIT / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            sections[current] = []
            continue
        assert current is not None, f"{name}: {line!r} before any section"
        key, sep, value = line.partition("=")
        assert sep, f"{name}: not KEY=VALUE: {line!r}"
        sections[current].append((key.strip(), value.strip()))
    return sections


def one(sections: dict[str, list[tuple[str, str]]], section: str, key: str) -> str:
    values = [v for k, v in sections.get(section, []) if k == key]
    assert len(values) == 1, f"{section}.{key}: {values}"
    return values[0]


def env_file(path: Path) -> dict[str, str]:
    out = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"{path}: bad line {raw!r}"
            out[key] = value
    return out


def expand_exec(line: str, env: dict[str, str], instance: str) -> list[str]:
    """systemd's ExecStart expansion: ``%i``; ``${VAR}`` is one word, ``$VAR`` splits on whitespace."""
    words = []
    for word in shlex.split(line.replace("%i", instance)):
        whole = re.fullmatch(r"\$(\w+)", word)
        if whole:
            words += env.get(whole.group(1), "").split()
            continue
        words.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word))
    return words


def referenced_vars(line: str) -> set[str]:
    return set(re.findall(r"\$\{?(\w+)\}?", line))


# ----------------------------------------------------------------------------- the CLI parser itself

def test_parse_cli_accepts_a_real_command_and_rejects_bad_ones():
    name, params = parse_cli(["supernode", "--superlink", "h:1", "--partition-id", "1", "--num-partitions", "2"])
    assert name == "supernode" and params["partition_id"] == 1 and params["superlink_addr"] == "h:1"
    with pytest.raises(click.UsageError):
        parse_cli(["supernode", "--superlink", "h:1", "--partition-id", "1", "--num-partitions", "2", "--gpu"])
    with pytest.raises(click.UsageError):
        parse_cli(["supernode", "--superlink", "h:1", "--partition-id", "one", "--num-partitions", "2"])
    with pytest.raises(click.UsageError):
        parse_cli(["supernode", "--superlink", "h:1"])  # required options missing


# ----------------------------------------------------------------------------- packaging

def test_package_data_lists_exactly_the_kit_files():
    pyproject = ROOT / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("not a source checkout (no pyproject.toml next to the package)")
    globs = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["graphfl.deploy"]
    files = sorted(p.relative_to(KIT.parent).as_posix() for p in KIT.iterdir() if p.is_file())
    assert files, "deploy/kit is empty"
    for f in files:
        assert any(fnmatch.fnmatch(f, g) for g in globs), f"{f} is not in package-data {globs}"
    for g in globs:
        assert any(fnmatch.fnmatch(f, g) for f in files), f"package-data {g!r} matches no file"


# ----------------------------------------------------------------------------- Dockerfiles

@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_args_entrypoint_and_user(name):
    ins = dockerfile(name)
    args = docker_args(name)
    env_keys = set()
    for i, rest in ins:
        if i == "ENV":
            env_keys |= set(re.findall(r"(\w+)=", rest))
    declared = set(args) | env_keys | {"PATH"}
    for i, rest in ins:
        if i in ("FROM", "RUN", "ENV", "COPY", "USER", "WORKDIR"):
            for var in re.findall(r"\$\{?(\w+)\}?", rest):
                assert var in declared, f"{name}: {i} uses ${var}, which is no ARG/ENV"
    assert args["TORCH_VERSION"] and args["TORCH_INDEX"].startswith("https://download.pytorch.org/whl/")
    assert any(i == "RUN" and '"torch==${TORCH_VERSION}"' in r and "${TORCH_INDEX}" in r for i, r in ins)
    entry = [json.loads(r) for i, r in ins if i == "ENTRYPOINT"]
    assert entry == [["graphfl"]]
    pyproject = ROOT / "pyproject.toml"
    if pyproject.is_file():
        assert "graphfl" in tomllib.loads(pyproject.read_text())["project"]["scripts"]
    cmd = [json.loads(r) for i, r in ins if i == "CMD"][-1]
    result = CliRunner().invoke(app, cmd)
    assert result.exit_code == 0, result.output
    users = [r for i, r in ins if i == "USER"]
    assert users and users[-1] not in ("root", "0"), f"{name} must run as a non-root user"
    assert any(i == "VOLUME" for i, _ in ins)
    text = (KIT / name).read_text()
    assert not re.search(r"\.(key|pem)\b|PASSWORD|SECRET|TOKEN", text.split("\nFROM", 1)[1]), \
        f"{name} must not bake secrets into the image"


def test_cpu_dockerfile_is_slim_python_cpu_torch_and_arch_neutral():
    args = docker_args("Dockerfile")
    assert args["PYTHON_IMAGE"] == "python:3.11-slim"
    assert args["TORCH_VERSION"] == "2.13.0" and args["TORCH_INDEX"].endswith("/whl/cpu")
    steps = " ".join(rest for _, rest in dockerfile("Dockerfile")).lower()
    for x86_only in ("--platform", "amd64", "x86_64", "x86-64", "+cpu.cxx11"):
        assert x86_only not in steps


def test_cuda_dockerfile_uses_a_cuda_base_and_a_cuda_torch_index():
    args = docker_args("Dockerfile.cuda")
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:") and "runtime" in args["CUDA_IMAGE"]
    assert re.search(r"/whl/cu\d+$", args["TORCH_INDEX"])
    assert args["TORCH_VERSION"] == docker_args("Dockerfile")["TORCH_VERSION"]


def test_dockerignore_keeps_secrets_and_environments_out_of_the_build_context():
    ignore = ROOT / ".dockerignore"
    if not (ROOT / "pyproject.toml").is_file():
        pytest.skip("not a source checkout")
    patterns = ignore.read_text().split()
    for p in (".git", ".venv", "certs", "runs"):
        assert p in patterns


# ----------------------------------------------------------------------------- compose

def _services(*files: str) -> dict[str, Any]:
    return load_compose(*files)["services"]


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.gpu.yaml")], ids=["cpu", "gpu"])
def test_compose_commands_are_accepted_by_the_cli(files):
    services = _services(*files)
    assert set(services) >= {"superlink", "supernode-0", "supernode-1"}
    parsed = {name: parse_cli(svc["command"]) for name, svc in services.items()}
    assert parsed["superlink"][0] == "superlink"
    link = parsed["superlink"][1]
    assert link["host"] == "0.0.0.0" and not link["insecure"] and str(link["certs_dir"]) == "/certs"
    nodes = [p for n, (c, p) in parsed.items() if c == "supernode"]
    assert len(nodes) == 2
    assert sorted(p["partition_id"] for p in nodes) == [0, 1]
    for p in nodes:
        assert p["num_partitions"] == 2
        assert p["superlink_addr"] == f"superlink:{link['port']}"
        assert not p["insecure"] and str(p["root_certificates"]) == "/certs/ca.crt"
        assert p["device"] == ("cuda" if "compose.gpu.yaml" in files else "cpu")
    for name, svc in services.items():
        assert "/certs" in [v.split(":")[1] for v in svc["volumes"]], f"{name} does not mount the certs"
        assert any(v.endswith(":/certs:ro") for v in svc["volumes"]), f"{name} must mount certs read-only"
        assert svc["restart"] in ("no", "on-failure:5")
        build = svc["build"]
        assert (KIT / build["context"] / build["dockerfile"]).is_file()
        assert set(build["args"]) <= set(docker_args(Path(build["dockerfile"]).name)), \
            f"{name}: build args {sorted(build['args'])} not all ARGs of {build['dockerfile']}"
        assert build["args"]["TORCH_VERSION"] == docker_args(Path(build["dockerfile"]).name)["TORCH_VERSION"]


def test_compose_submit_service_targets_the_superlink():
    services = _services("compose.yaml")
    name, p = parse_cli(services["submit"]["command"])
    assert name == "run" and p["superlink"] == "superlink:9091" and str(p["root_certificates"]) == "/certs/ca.crt"
    assert p["nodes"] == 2 and "submit" in services["submit"]["profiles"]


def test_compose_gpu_variant_reserves_nvidia_gpus_for_supernodes_only():
    services = _services("compose.yaml", "compose.gpu.yaml")
    for name in ("supernode-0", "supernode-1"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        assert services[name]["build"]["dockerfile"].endswith("Dockerfile.cuda")
        assert services[name]["image"] == "graphfl:cuda"
    assert "deploy" not in services["superlink"] and services["superlink"]["image"] == "graphfl:cpu"


# ----------------------------------------------------------------------------- systemd units

ENV = env_file(KIT / "graphfl.env")


@pytest.mark.parametrize("name", UNITS)
def test_unit_restart_policy_user_and_environment(name):
    u = unit(name)
    assert one(u, "Service", "Restart") == "on-failure"
    assert int(one(u, "Unit", "StartLimitBurst")) >= 1 and int(one(u, "Unit", "StartLimitIntervalSec")) > 0
    assert one(u, "Service", "User") == "graphfl" and one(u, "Service", "Group") == "graphfl"
    files = [v for k, v in u["Service"] if k == "EnvironmentFile"]
    assert files[0] == "/etc/graphfl/graphfl.env"
    assert one(u, "Install", "WantedBy") == "multi-user.target"
    path = [v for k, v in u["Service"] if k == "Environment" and v.startswith("PATH=")]
    assert path and "/opt/graphfl/venv/bin" in path[0].split("=", 1)[1].split(":"), \
        "graphfl execs flower-superlink / flower-supernode from PATH: the venv must be on it"
    for var in referenced_vars(one(u, "Service", "ExecStart")):
        assert var in ENV, f"{name}: ExecStart uses ${var}, not set in graphfl.env"


@pytest.mark.parametrize("name", ["graphfl-supernode@.service", "graphfl-peer@.service"])
def test_gpu_units_avoid_hardening_that_hides_gpus(name):
    keys = {k for k, _ in unit(name)["Service"]}
    for breaks_cuda in ("PrivateDevices", "DevicePolicy", "MemoryDenyWriteExecute", "PrivateUsers", "ProcSubset"):
        assert breaks_cuda not in keys
    assert {"NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp"} <= keys


@pytest.mark.parametrize("name,command", [("graphfl-superlink.service", "superlink"),
                                          ("graphfl-supernode@.service", "supernode")])
def test_unit_execstart_is_accepted_by_the_cli(name, command):
    argv = expand_exec(one(unit(name), "Service", "ExecStart"), ENV, "1")
    assert argv[0] == GRAPHFL_BIN
    got, params = parse_cli(argv[1:])
    assert got == command and not params.get("insecure")
    if command == "supernode":
        assert params["partition_id"] == 1 and params["num_partitions"] == int(ENV["GRAPHFL_NUM_PARTITIONS"])
        assert params["device"] == "auto" and params["clientapp_mode"] == "warm"
    # extra options from the environment file are split into words like systemd does
    extra = {"graphfl-superlink.service": ("GRAPHFL_SUPERLINK_ARGS", "--node-auth"),
             "graphfl-supernode@.service": ("GRAPHFL_SUPERNODE_ARGS", "--auth-key /etc/graphfl/certs/node.key")}[name]
    argv = expand_exec(one(unit(name), "Service", "ExecStart"), {**ENV, extra[0]: extra[1]}, "0")
    parse_cli(argv[1:])


def _flower_help(exe: str) -> str:
    path = Path(sys.executable).with_name(exe)
    out = subprocess.run([str(path) if path.exists() else exe, "--help"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_unit_commands_exec_flower_command_lines_flower_accepts(tmp_path, monkeypatch):
    """Run the units' commands (in-process, certificates from ``graphfl certs``) up to the exec,
    and check the Flower command lines they would exec against Flower's own ``--help``."""
    from graphfl.deploy import supernode as wrapper

    certs = tmp_path / "certs"
    assert CliRunner().invoke(app, ["certs", str(certs), "--node-keys", "1"]).exit_code == 0
    env = {**ENV, "GRAPHFL_CERTS": str(certs), "GRAPHFL_SUPERLINK_ARGS": "--node-auth",
           "GRAPHFL_SUPERNODE_ARGS": f"--auth-key {certs}/keys/node_0"}
    execs: list[list[str]] = []

    def fake_exec(file: str, argv: list[str]) -> None:
        execs.append(list(argv))
        raise SystemExit(0)

    monkeypatch.setattr(os, "execvp", fake_exec)
    from graphfl.deploy.processes import QUIET_FLOWER_ENV

    for key, value in QUIET_FLOWER_ENV.items():  # the commands set these before exec: undone after the test
        monkeypatch.setenv(key, os.environ.get(key, value))
    for name in ("graphfl-superlink.service", "graphfl-supernode@.service"):
        argv = expand_exec(one(unit(name), "Service", "ExecStart"), env, "0")
        result = CliRunner().invoke(app, argv[1:])
        assert result.exit_code == 0, result.output
    link, node = execs
    assert link[1:4] == ["-m", "graphfl.deploy.superlink", "--"]  # graphfl's path-gated SuperLink
    flower_link = set(re.findall(r"--[\w-]+", _flower_help("flower-superlink")))
    assert set(long_options(link[4:])) <= flower_link
    assert "--enable-supernode-auth" in link and "--insecure" not in link
    assert node[1:3] == ["-m", "graphfl.deploy.supernode"]
    ours, flower = wrapper.parse_args(node[3:])
    assert ours.clientapp_mode == "warm" and ours.device == "auto"
    flower_node = set(re.findall(r"--[\w-]+", _flower_help("flower-supernode")))
    assert set(long_options(flower)) <= flower_node
    assert flower[flower.index("--root-certificates") + 1] == str(certs / "ca.crt")
    assert flower[flower.index("--auth-supernode-private-key") + 1] == str(certs / "keys" / "node_0")


def _run_peer_script(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    stub = tmp_path / "graphfl-stub"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    return subprocess.run(["sh", str(KIT / "graphfl-peer-start.sh"), *args], capture_output=True, text=True,
                          timeout=60, env={"PATH": os.environ["PATH"], **env, "GRAPHFL_BIN": str(stub)})


def test_peer_unit_runs_the_start_script_which_resumes_from_a_checkpoint(tmp_path):
    u = unit("graphfl-peer@.service")
    argv = expand_exec(one(u, "Service", "ExecStart"), ENV, "3")
    assert Path(argv[0]).name == "graphfl-peer-start.sh" and argv[1:] == ["3"]
    assert os.access(KIT / "graphfl-peer-start.sh", os.X_OK)
    out = tmp_path / "p2p"
    env = {**ENV, "GRAPHFL_PEER_OUT": str(out), "GRAPHFL_PEER_ARGS": "--set rounds=50"}
    first = _run_peer_script(tmp_path, env, "3")
    assert first.returncode == 0, first.stderr
    cmd = json.loads(first.stdout)
    name, params = parse_cli(cmd)
    assert name == "peer" and params["peer_id"] == 3 and Path(params["out"]) == out and not params["resume"]
    assert list(params["set_"]) == ["rounds=50"] and str(params["topology"]) == ENV["GRAPHFL_NETWORK"]
    out.mkdir()
    (out / "peer-3.ckpt.json").write_text("{}")
    again = _run_peer_script(tmp_path, env, "3")
    assert again.returncode == 0, again.stderr
    assert parse_cli(json.loads(again.stdout))[1]["resume"] is True
    assert parse_cli(json.loads(_run_peer_script(tmp_path, env, "4").stdout))[1]["resume"] is False
    bad = _run_peer_script(tmp_path, env, "x")
    assert bad.returncode == 2 and "peer id" in bad.stderr


def test_peer_checkpoint_name_matches_the_start_script():
    from graphfl.p2p.checkpoint import json_path

    assert json_path("/o", 3).name == "peer-3.ckpt.json"
    assert '"$out/peer-$id.ckpt.json"' in (KIT / "graphfl-peer-start.sh").read_text()


def test_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed on this machine")
    graphfl_bin = Path(sys.executable).with_name("graphfl")
    if not graphfl_bin.exists():
        pytest.skip(f"no graphfl console script next to {sys.executable} (package not installed)")
    for name in UNITS:  # verify checks that the executables exist: point them at real ones
        text = (KIT / name).read_text().replace(GRAPHFL_BIN, str(graphfl_bin))
        text = text.replace("/opt/graphfl/bin/graphfl-peer-start.sh", str(KIT / "graphfl-peer-start.sh"))
        (tmp_path / name).write_text(text)
    out = subprocess.run([tool, "verify", *(str(tmp_path / n) for n in UNITS)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    ours = [line for line in (out.stdout + out.stderr).splitlines() if "graphfl" in line]
    assert out.returncode == 0 and not ours, out.stdout + out.stderr


# ----------------------------------------------------------------------------- graphfl certs

def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _same_key(priv: Any, cert: x509.Certificate) -> bool:
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return priv.public_key().public_bytes(*fmt) == cert.public_key().public_bytes(*fmt)


def test_certs_makes_everything_for_n_devices(tmp_path):
    out = tmp_path / "certs"
    result = CliRunner().invoke(app, ["certs", str(out), "--host", "superlink", "--host", "10.0.0.1",
                                      "--node-keys", "3", "--peers", "4", "--peer-host", "10.0.0.5", "--days", "30"])
    assert result.exit_code == 0, result.output
    ca = _cert(out / "ca.crt")
    server = _cert(out / "server.pem")
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "superlink" in san.get_values_for_type(x509.DNSName)
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} >= {"10.0.0.1", "127.0.0.1"}
    assert 29 <= (server.not_valid_after_utc - server.not_valid_before_utc).days <= 31
    assert _same_key(serialization.load_pem_private_key((out / "server.key").read_bytes(), None), server)
    secrets = [out / "ca.key", out / "server.key", out / "p2p" / "ca.key"]
    for i in range(3):
        priv = serialization.load_ssh_private_key((out / "keys" / f"node_{i}").read_bytes(), None)
        pub = serialization.load_ssh_public_key((out / "keys" / f"node_{i}.pub").read_bytes())
        fmt = (serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        assert priv.public_key().public_bytes(*fmt) == pub.public_bytes(*fmt)
        secrets.append(out / "keys" / f"node_{i}")
    assert not (out / "keys" / "node_3").exists()
    p2p_ca = _cert(out / "p2p" / "ca.crt")
    for i in range(4):
        cert = _cert(out / "p2p" / f"peer-{i}.crt")
        cert.verify_directly_issued_by(p2p_ca)
        with pytest.raises(ValueError):
            cert.verify_directly_issued_by(ca)  # the p2p network has its own CA
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == f"peer-{i}"
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert f"peer-{i}" in san.get_values_for_type(x509.DNSName)
        assert "10.0.0.5" in {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(eku)
        key_path = out / "p2p" / f"peer-{i}.key"
        assert _same_key(serialization.load_pem_private_key(key_path.read_bytes(), None), cert)
        secrets.append(key_path)
    assert not (out / "p2p" / "peer-4.crt").exists()
    for path in secrets:
        assert _mode(path) == 0o600, f"{path} is {oct(_mode(path))}"


def test_certs_without_extras_writes_no_keys_or_peers(tmp_path):
    result = CliRunner().invoke(app, ["certs", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["ca.crt", "ca.key", "server.key", "server.pem"]


@pytest.mark.parametrize("args,word", [(["--peers", "-1"], "--peers"), (["--node-keys", "-2"], "--node-keys"),
                                       (["--days", "0"], "--days")])
def test_certs_rejects_bad_counts(tmp_path, args, word):
    result = CliRunner().invoke(app, ["certs", str(tmp_path / "c"), *args])
    assert result.exit_code == 2 and word in result.output
    assert not (tmp_path / "c").exists()


# ----------------------------------------------------------------------------- the guide

def _guide() -> str:
    path = ROOT / "docs" / "edge-guide.md"
    if not path.is_file():
        pytest.skip("not a source checkout (docs/ absent)")
    return path.read_text()


def test_guide_network_file_is_valid_and_names_the_files_certs_writes(tmp_path):
    from graphfl.p2p.config import load_network_file

    text = _guide()
    block = re.search(r"```toml\n(\[network\].*?)```", text, re.S)
    assert block, "docs/edge-guide.md lost its network file example"
    (tmp_path / "network.toml").write_text(block.group(1))
    net = load_network_file(tmp_path / "network.toml")
    assert net.topology.n == 3 and not net.tls.insecure
    made = tmp_path / "fed-certs"
    assert CliRunner().invoke(app, ["certs", str(made), "--peers", "3"]).exit_code == 0
    for i in range(3):
        files = net.tls_files(i)
        assert files.ca == Path("/etc/graphfl/certs/p2p/ca.crt")
        for want in (files.cert, files.key):  # the guide installs fed-certs/p2p/<name> under that folder
            assert want.parent == Path("/etc/graphfl/certs/p2p") and (made / "p2p" / want.name).is_file()


def test_guide_graphfl_commands_parse():
    """Every one-line ``graphfl ...`` command of the guide is accepted by the CLI parser."""
    text = _guide().replace("\\\n", " ")
    commands = [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
                for line in block.splitlines() if line.strip().startswith("graphfl ")]
    commands += [re.sub(r".*?/opt/graphfl/venv/bin/graphfl ", "graphfl ", line.strip())
                 for line in text.splitlines() if "/opt/graphfl/venv/bin/graphfl run" in line]
    commands += [re.sub(r".*? graphfl:(cpu|cuda) ", "graphfl ", line.strip())
                 for line in text.splitlines() if line.strip().startswith("docker run")]
    assert len(commands) >= 6, commands
    for line in commands:
        argv = shlex.split(line.split("#")[0])[1:]
        name, _ = parse_cli(argv)
        assert name in ("certs", "run", "superlink", "supernode", "peer")


def test_certs_refuses_to_replace_an_existing_ca_unless_asked(tmp_path):
    out = tmp_path / "c"
    assert CliRunner().invoke(app, ["certs", str(out), "--peers", "1"]).exit_code == 0
    before = (out / "ca.crt").read_bytes()
    again = CliRunner().invoke(app, ["certs", str(out)])
    assert again.exit_code == 2 and "--overwrite" in again.output
    assert (out / "ca.crt").read_bytes() == before
    assert CliRunner().invoke(app, ["certs", str(out), "--overwrite"]).exit_code == 0
    assert (out / "ca.crt").read_bytes() != before


def test_the_supernode_entry_point_exits_even_if_a_thread_never_stops(tmp_path):
    """Flower's Runtime HTTP API thread outlives a failed SuperNode main loop: the process must
    still exit (with its code) within the grace, or a launcher waits on it forever."""
    import subprocess
    import sys
    import time

    script = (
        "import threading, time\n"
        "from graphfl.deploy.supernode import exit_within\n"
        "threading.Thread(target=time.sleep, args=(600,)).start()   # non-daemon, never ends in time\n"
        "exit_within(3, grace=0.5)\n"
    )
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert time.monotonic() - t0 < 30
    assert "did not stop" in proc.stderr
    # without a hanging thread it is a plain exit: no hard-exit message
    quick = subprocess.run([sys.executable, "-c", "from graphfl.deploy.supernode import exit_within\n"
                            "exit_within(0, grace=30)"], capture_output=True, text=True, timeout=60)
    assert quick.returncode == 0 and "did not stop" not in quick.stderr
