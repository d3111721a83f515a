"""The command a missing-extra message gives: ``pip install -e ".[extra]"`` from a source checkout (prefixcache is not
on the package index, so ``pip install 'prefixcache[extra]'`` fails there), ``pip install 'prefixcache[extra]'``
from an installed wheel; every such message in the package comes from :func:`prefixcache.errors.install_command`."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

from prefixcache.errors import install_command

ROOT = Path(__file__).resolve().parents[1]


def test_from_the_checkout_it_is_an_editable_install_of_the_checkout(monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(ROOT)
    assert install_command("server") == 'pip install -e ".[server]"'
    monkeypatch.chdir(tmp_path)  # elsewhere, "." would name another folder: the checkout's path instead
    assert install_command("hf") == f'pip install -e "{ROOT}[hf]"'


def test_from_an_installed_wheel_it_is_the_distributions_extra(tmp_path) -> None:
    site = tmp_path / "site-packages" / "prefixcache"
    site.mkdir(parents=True)
    shutil.copy(ROOT / "prefixcache" / "errors.py", site / "errors.py")
    spec = importlib.util.spec_from_file_location("installed_errors", site / "errors.py")
    installed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(installed)
    assert installed.install_command("server") == "pip install 'prefixcache[server]'"


def test_no_message_in_the_package_spells_the_command_itself() -> None:
    spelled = re.compile(r"""pip install ["']?prefixcache\[""")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "prefixcache").rglob("*.py"))
        if path.name != "errors.py"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if spelled.search(line)
    ]
    assert offenders == []


def test_a_benchmark_without_transformers_is_one_line_naming_the_hf_extra(monkeypatch, capsys) -> None:
    import prefixcache.bench
    from prefixcache.cli import main

    def without_transformers(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    monkeypatch.setattr(prefixcache.bench, "run", without_transformers)
    assert main(["bench", "agent", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "this benchmark needs transformers: pip install" in err and "[hf]" in err and "Traceback" not in err
