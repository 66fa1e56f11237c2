"""The build context of the compose stack's schema registry image (docker/registry/Dockerfile).

Apicurio Registry 3.3 needs Java 21+, which Debian bookworm (the base of every image the stack
builds) does not package. So the image is assembled from what `astraflow registry up` already
uses on the host: Apicurio's application, resolved by `LocalRegistry.resolve` (Maven Central,
docker/registry/pom.xml), and a minimal Java runtime that `jlink` makes from the host's Java 21+
JDK (`find_java`). `bundle(out)` writes both into `out/dist` and `out/java`, and the registry's
JVM flags (`local_registry.JVM_FLAGS` and `storage_flags`: its H2 database in a file in the image's
volume) into `out/registry.args`, a Java argument file the image's entrypoint passes to `java`, so
the image and `astraflow registry up` run the registry with the same settings; `scripts/compose.sh
build-registry` builds the image from that folder. The jlinked runtime is kept next to the
resolved application (`local_registry.dist_dir`), once per JDK and module list; the folder is
made of hard links to both where the file system allows, so staging it costs no copy.

The host's JDK must be one built for an older or equal glibc than the image's (Temurin's are
built on an old one); a distribution's JDK from a newer release fails in the container at start.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from astraflow.config import LocalRegistrySettings
from astraflow.errors import LocalRegistryError, ToolMissingError
from astraflow.local_registry import (
    JVM_FLAGS,
    MIN_JAVA,
    Echo,
    LocalRegistry,
    find_java,
    java_version,
    storage_flags,
)

# What Apicurio's Quarkus application loads: the Java SE modules (JDBC for its H2 database,
# JNDI, management, XML, HTTP client, java.desktop for java.beans) and the jdk.* modules its
# libraries reach by reflection or service loading (Unsafe, zip file systems, DNS, TLS providers,
# extra charsets, JMX platform beans, socket options, JAAS/Kerberos). `jdeps` cannot compute
# this: the application mixes named modules and class-path jars, and it misses reflection.
RUNTIME_MODULES = (
    "java.se", "jdk.unsupported", "jdk.zipfs", "jdk.naming.dns", "jdk.crypto.ec", "jdk.crypto.cryptoki",
    "jdk.charsets", "jdk.management", "jdk.net", "jdk.security.auth", "jdk.security.jgss",
)
DIST, JAVA = "dist", "java"  # the folders of the build context; docker/registry/Dockerfile copies them
ARGS = "registry.args"  # the JVM flags file of the build context; the Dockerfile copies it and passes it to java
IMAGE_DATA_DIR = "/var/lib/apicurio"  # the image's volume, where its database lives (Dockerfile, docker-compose.yml)


def image_jvm_flags() -> list[str]:
    """The JVM flags of the image's registry, one per line in `registry.args` (heap and port: the entrypoint)."""
    return [*JVM_FLAGS, *storage_flags(IMAGE_DATA_DIR)]


def jdk_of(java: str) -> Path:
    """The JDK home of a `java` executable, checked to have `jlink` (a JRE alone cannot link)."""
    home = Path(java).resolve().parents[1]
    if not (home / "bin" / "jlink").exists():
        raise ToolMissingError(
            f"{java} belongs to a Java runtime without jlink; the registry image needs a JDK {MIN_JAVA}+: install "
            f"one (e.g. Temurin {MIN_JAVA}) or set local_registry.java (or $ASTRAFLOW_REGISTRY_JAVA) to a JDK's java"
        )
    return home


def link_runtime(settings: LocalRegistrySettings, echo: Echo = print) -> Path:
    """A minimal Java runtime jlinked from the host's Java 21+ JDK, made once per JDK and module list."""
    java = find_java(settings.java)
    home = jdk_of(java)
    listed = subprocess.run([java, "--list-modules"], capture_output=True, text=True, timeout=60).stdout
    have = {line.split("@")[0] for line in listed.split()}
    modules = [m for m in RUNTIME_MODULES if m in have]  # e.g. jdk.crypto.ec, folded into java.base in later JDKs
    version = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60).stderr
    key = hashlib.sha256(f"{home}\n{version}\n{','.join(modules)}".encode()).hexdigest()[:16]
    runtime = settings.dist_dir.expanduser().resolve() / f"jre-{key}"
    if (runtime / "bin" / "java").exists():
        return runtime
    echo(f"Linking a Java runtime for the registry image from {home} (once; about a minute)...")
    tmp = runtime.with_name(f".{runtime.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(home / "bin" / "jlink"), "--add-modules", ",".join(modules), "--strip-debug", "--no-man-pages",
           "--no-header-files", "--compress", "zip-6", "--output", str(tmp)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 or not (tmp / "bin" / "java").exists():
        shutil.rmtree(tmp, ignore_errors=True)
        raise LocalRegistryError(f"jlink could not make the registry's Java runtime:\n{(res.stdout + res.stderr)[-3000:]}")
    try:
        tmp.rename(runtime)
    except OSError:  # another process linked the same runtime meanwhile: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return runtime


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed there
        shutil.copy2(src, dst)


def bundle(out: Path, settings: LocalRegistrySettings | None = None, echo: Echo = print) -> Path:
    """Writes the registry image's build context into `out` (`dist/`, `java/`, `registry.args`) and returns it."""
    settings = settings or LocalRegistrySettings()
    dist = LocalRegistry(settings).resolve(echo)
    runtime = link_runtime(settings, echo)
    out = out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    for src, name in ((dist, DIST), (runtime, JAVA)):
        shutil.rmtree(out / name, ignore_errors=True)
        shutil.copytree(src, out / name, symlinks=True, copy_function=_link_or_copy,
                        ignore=shutil.ignore_patterns(".resolved", "PaxHeaders.*"))  # tar metadata
    if java_version(str(out / JAVA / "bin" / "java")) < MIN_JAVA:
        raise LocalRegistryError(f"the runtime staged at {out / JAVA} does not run as Java {MIN_JAVA}+")
    (out / ARGS).write_text("\n".join(image_jvm_flags()) + "\n")
    return out
