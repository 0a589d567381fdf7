"""``lowband flower run`` does not talk to a SuperLink beyond loopback in clear unless told
(issue 25: Flower with TLS, or loopback-only and said so).

Without TLS the app (code every SuperNode runs) and the model go in clear to whoever answers at
the address. Loopback stays zero-config, as for the other commands; beyond it the command needs
the SuperLink's CA (``--root-certificates``) or an explicit ``--insecure``.
"""

from __future__ import annotations

import pytest

from cli import main
from diloco.flower import federation
from diloco.flower.federation import SubmitConfig, write_flwr_home
from lowband.errors import ConfigError

pytestmark = [pytest.mark.security, pytest.mark.timeout(60)]


@pytest.mark.parametrize(
    "superlink", ["10.0.0.5:9093", "superlink:9093", "0.0.0.0:9093", "flwr.example.org:443"]
)
def test_a_superlink_beyond_loopback_needs_tls_or_insecure(superlink) -> None:
    with pytest.raises(ConfigError, match="--root-certificates") as err:
        SubmitConfig(superlink=superlink)
    assert "--insecure" in str(err.value)
    SubmitConfig(superlink=superlink, root_certificates="ca.pem")
    SubmitConfig(superlink=superlink, insecure=True)


@pytest.mark.parametrize("superlink", ["127.0.0.1:9093", "localhost:9093", "[::1]:9093"])
def test_loopback_stays_zero_config(superlink, monkeypatch) -> None:
    submitted: list[SubmitConfig] = []
    monkeypatch.setattr(federation, "submit", lambda cfg, **_: submitted.append(cfg))
    assert main(["flower", "run", "--superlink", superlink, "--quiet"]) == 0
    # the command went ahead without --root-certificates or --insecure, and turned on neither
    [cfg] = submitted
    assert (cfg.superlink, cfg.root_certificates, cfg.insecure) == (superlink, None, False)


def test_the_command_refuses_before_starting_anything(capsys) -> None:
    assert main(["flower", "run", "--superlink", "10.0.0.5:9093"]) == 2
    err = capsys.readouterr().err
    assert "--root-certificates" in err and "--insecure" in err


def test_the_flwr_config_uses_tls_when_given_a_ca(tmp_path) -> None:
    tls = write_flwr_home(tmp_path / "a", "h:1", root_certificates="/ca.pem") / "config.toml"
    text = tls.read_text()
    assert 'root-certificates = "/ca.pem"' in text and "insecure" not in text
    plain = (write_flwr_home(tmp_path / "b", "127.0.0.1:1") / "config.toml").read_text()
    assert "insecure = true" in plain
