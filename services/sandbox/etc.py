"""The /etc a sandbox on base ``"host"`` sees: synthesized, not the host's.

The host's /etc holds its users, hosts, resolver, credentials and service configuration: nothing a sandbox
needs and much it should not read. Unless ``/etc`` is listed in ``host_paths`` (an explicit choice), the
backend writes one small /etc per instance at start and binds it read-only into every sandbox:

* ``passwd`` / ``group``: root (the sandbox user, uid 0 inside its user namespace) and nobody, home the
  work directory;
* ``hosts`` (localhost and the sandbox's hostname), ``hostname``, ``nsswitch.conf`` (files, then dns),
  ``resolv.conf`` (no name server inside: names are resolved by the egress proxy, ``HTTP(S)_PROXY``);
* ``ssl/certs/ca-certificates.crt`` (a copy of the host's CA bundle, if it has one), so HTTPS through the
  proxy verifies;
* copies of the static tables programs expect (``protocols``, ``services``, ``ld.so.cache``) and the
  ``os-release`` link;
* ``alternatives``: a mount point for the host's /etc/alternatives (read-only; only links to programs in
  the system trees), without which ``awk``, ``editor`` and friends do not resolve.

:data:`ETC_HOST_BINDS` lists what is bound from the host; everything else is written here.
"""

from __future__ import annotations

import os
import shutil

from services.sandbox.config import SandboxConfig

#: host paths bound read-only into the synthesized /etc (source, destination inside the sandbox)
ETC_HOST_BINDS = [("/etc/alternatives", "/etc/alternatives")]
#: host files copied as they are (static tables, no secrets); missing ones are skipped
ETC_HOST_COPIES = ["protocols", "services", "ld.so.cache"]
#: where Debian-like hosts keep the CA bundle (the first that exists is copied)
CA_BUNDLES = ["/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt"]


def synthesized_etc(cfg: SandboxConfig) -> dict[str, str]:
    """The text files of the synthesized /etc (relative path -> content)."""
    home = cfg.workdir
    return {
        "passwd": f"root:x:0:0:sandbox:{home}:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": "root:x:0:\nnogroup:x:65534:\n",
        "hosts": f"127.0.0.1\tlocalhost {cfg.hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        "hostname": f"{cfg.hostname}\n",
        "nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\n"
                         "protocols: files\nservices: files\n",
        "resolv.conf": "# no name server inside the sandbox: the egress proxy (HTTP_PROXY / HTTPS_PROXY) resolves names\n"
                       "options ndots:0 attempts:1 timeout:1\n",
    }


def write_etc(cfg: SandboxConfig, target: str) -> None:
    """Write the synthesized /etc into ``target`` (world-readable, owned by root)."""
    os.makedirs(target, mode=0o755)
    for rel, text in synthesized_etc(cfg).items():
        with open(os.path.join(target, rel), "w") as f:
            f.write(text)
        os.chmod(os.path.join(target, rel), 0o644)
    for name in ETC_HOST_COPIES:
        src = os.path.join("/etc", name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(target, name))
            os.chmod(os.path.join(target, name), 0o644)
    for bundle in CA_BUNDLES:
        if os.path.isfile(bundle):
            certs = os.path.join(target, "ssl", "certs")
            os.makedirs(certs, mode=0o755)
            shutil.copyfile(bundle, os.path.join(certs, "ca-certificates.crt"))
            os.chmod(os.path.join(certs, "ca-certificates.crt"), 0o644)
            os.symlink("certs/ca-certificates.crt", os.path.join(target, "ssl", "cert.pem"))
            break
    if os.path.exists("/usr/lib/os-release"):
        os.symlink("../usr/lib/os-release", os.path.join(target, "os-release"))
    for src, dest in ETC_HOST_BINDS:
        if os.path.isdir(src):
            os.makedirs(os.path.join(target, os.path.relpath(dest, "/etc")), mode=0o755)


def etc_args(target: str) -> list[str]:
    """bwrap arguments binding the synthesized /etc at ``target`` (and the host paths it takes) read-only."""
    args = ["--ro-bind", target, "/etc"]
    for src, dest in ETC_HOST_BINDS:
        if os.path.isdir(src):
            args += ["--ro-bind", src, dest]
    return args
