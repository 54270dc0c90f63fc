#!/usr/bin/python3
"""Run a command with a systemd unit's [Service] sandboxing applied as systemd 252 (Debian 12)
applies it, on machines whose PID 1 is not systemd (CI containers, test VMs).

    unit-sandbox.py --unit redis-server [--dropin-dir DIR]... [--set Key=Value]...
                    [--report FILE] [--show] -- CMD ARGS...

The unit is read as systemd reads it: the first NAME.service found in /etc/systemd/system,
/run/systemd/system, /lib/systemd/system (a template NAME@.service for NAME@INSTANCE), then the
drop-ins (*.conf in NAME.service.d, the template's, the dash-prefix ones and service.d, and in
each --dropin-dir, which rank above /etc), ordered by file name; --set lines come last. List
settings accumulate and an empty assignment resets them. CMD replaces the unit's ExecStart=.

What it applies, in systemd's order (src/core/execute.c exec_child): resource limits (with
the manager's DefaultLimitNOFILE=1024:524288 and DefaultLimitMEMLOCK=8M), OOMScoreAdjust=,
the User=/Group= groups (initgroups, SupplementaryGroups=), the exec directories
(RuntimeDirectory= &c.), PrivateNetwork=, PrivateIPC=, the mount namespace (namespace.c's mount
entries, sorted, deduplicated and applied the same way: ProtectSystem=, ProtectHome=,
Read{Write,Only}Paths=, InaccessiblePaths=, {No,}ExecPaths=, Bind{ReadOnly,}Paths=,
TemporaryFileSystem=, PrivateTmp=, PrivateDevices=, ProtectKernel{Tunables,Modules,Logs}=,
ProtectControlGroups=, ProtectProc=, ProcSubset=, ProtectHostname=), PrivateUsers= (a user
namespace mapping root and the unit's user to themselves, set up after the mount namespace, so
the mounts stay locked), CapabilityBoundingSet=, the uid, WorkingDirectory=, NoNewPrivileges=
(also implied as systemd implies it), then the seccomp filters built with libseccomp as
seccomp-util.c builds them (RestrictAddressFamilies=, MemoryDenyWriteExecute=,
RestrictRealtime=, RestrictSUIDSGID=, RestrictNamespaces=, ProtectKernelTunables=,
ProtectKernelModules=, ProtectKernelLogs=, ProtectClock=, PrivateDevices=,
SystemCallArchitectures=, LockPersonality=, and SystemCallFilter= last, killing the process
unless SystemCallErrorNumber=), and execs CMD with the unit's environment.

Every setting it does not apply is named on stderr once and in --report (JSON), never
silently dropped. Exit statuses of set-up failures are systemd's (226 namespace, 228 seccomp…).
Needs root, /usr/bin/python3 with python3-seccomp, and systemd-analyze (for the syscall
groups, exactly as this systemd defines them).
"""

import argparse
import ctypes
import errno
import grp
import json
import os
import pwd
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile

import seccomp

UNIT_DIRS = ["/etc/systemd/system", "/run/systemd/system", "/lib/systemd/system", "/usr/lib/systemd/system"]
# systemd's compiled-in DEFAULT_PATH (Debian 12 builds with split-usr).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

EXIT = {
    "chdir": 200, "exec": 203, "limits": 205, "oom_adjust": 206, "group": 216, "user": 217,
    "capabilities": 218, "network": 225, "namespace": 226, "no_new_privileges": 227,
    "seccomp": 228, "address_families": 232, "runtime_directory": 233, "state_directory": 238,
    "cache_directory": 239, "logs_directory": 240, "configuration_directory": 241,
}

# Settings that tell the service manager what to do (start, stop, restart, notify, log
# identity): they change nothing the process can do, so there is nothing to apply.
MANAGER_ONLY = {
    "Type", "ExecStart", "ExecStartPre", "ExecStartPost", "ExecStop", "ExecStopPost",
    "ExecReload", "ExecCondition", "Restart", "RestartSec", "RestartPreventExitStatus",
    "RestartForceExitStatus", "SuccessExitStatus", "PIDFile", "TimeoutSec", "TimeoutStartSec",
    "TimeoutStopSec", "TimeoutAbortSec", "RuntimeMaxSec", "WatchdogSec", "KillMode",
    "KillSignal", "FinalKillSignal", "SendSIGKILL", "SendSIGHUP", "RemainAfterExit",
    "GuessMainPID", "NotifyAccess", "SyslogIdentifier", "SyslogFacility", "SyslogLevel",
    "SyslogLevelPrefix", "PermissionsStartOnly", "BusName", "FileDescriptorStoreMax",
    "OOMPolicy", "CPUAccounting", "MemoryAccounting", "TasksAccounting", "IOAccounting",
    "IPAccounting", "StartLimitIntervalSec", "StartLimitBurst", "ReloadSignal",
}

# Settings applied to the process by this runner.
APPLIED = {
    "User", "Group", "SupplementaryGroups", "UMask", "Environment", "EnvironmentFile",
    "PassEnvironment", "UnsetEnvironment", "WorkingDirectory", "OOMScoreAdjust", "Nice",
    "RuntimeDirectory", "RuntimeDirectoryMode", "StateDirectory", "StateDirectoryMode",
    "CacheDirectory", "CacheDirectoryMode", "LogsDirectory", "LogsDirectoryMode",
    "ConfigurationDirectory", "ConfigurationDirectoryMode", "CapabilityBoundingSet",
    "NoNewPrivileges", "SystemCallFilter", "SystemCallErrorNumber", "SystemCallArchitectures",
    "RestrictAddressFamilies", "MemoryDenyWriteExecute", "RestrictNamespaces",
    "RestrictRealtime", "RestrictSUIDSGID", "LockPersonality", "ProtectClock",
    "ProtectHostname", "ProtectKernelModules", "ProtectKernelLogs", "ProtectKernelTunables",
    "ProtectControlGroups", "ProtectHome", "ProtectSystem", "ProtectProc", "ProcSubset",
    "PrivateTmp", "PrivateDevices", "PrivateUsers", "PrivateNetwork", "PrivateIPC",
    "PrivateMounts", "ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths", "ExecPaths",
    "NoExecPaths", "BindPaths", "BindReadOnlyPaths", "TemporaryFileSystem", "IgnoreSIGPIPE",
    "MountAPIVFS",
}

# Old names systemd still accepts.
ALIASES = {
    "ReadWriteDirectories": "ReadWritePaths",
    "ReadOnlyDirectories": "ReadOnlyPaths",
    "InaccessibleDirectories": "InaccessiblePaths",
}

LIST_SETTINGS = {
    "Environment", "EnvironmentFile", "PassEnvironment", "UnsetEnvironment",
    "SupplementaryGroups", "RuntimeDirectory", "StateDirectory", "CacheDirectory",
    "LogsDirectory", "ConfigurationDirectory", "ReadWritePaths", "ReadOnlyPaths",
    "InaccessiblePaths", "ExecPaths", "NoExecPaths", "BindPaths", "BindReadOnlyPaths",
    "TemporaryFileSystem", "SystemCallArchitectures",
}

RLIMITS = {
    "LimitCPU": ("RLIMIT_CPU", "sec"), "LimitFSIZE": ("RLIMIT_FSIZE", "bytes"),
    "LimitDATA": ("RLIMIT_DATA", "bytes"), "LimitSTACK": ("RLIMIT_STACK", "bytes"),
    "LimitCORE": ("RLIMIT_CORE", "bytes"), "LimitRSS": ("RLIMIT_RSS", "bytes"),
    "LimitNOFILE": ("RLIMIT_NOFILE", "n"), "LimitAS": ("RLIMIT_AS", "bytes"),
    "LimitNPROC": ("RLIMIT_NPROC", "n"), "LimitMEMLOCK": ("RLIMIT_MEMLOCK", "bytes"),
    "LimitLOCKS": ("RLIMIT_LOCKS", "n"), "LimitSIGPENDING": ("RLIMIT_SIGPENDING", "n"),
    "LimitMSGQUEUE": ("RLIMIT_MSGQUEUE", "bytes"), "LimitNICE": ("RLIMIT_NICE", "nice"),
    "LimitRTPRIO": ("RLIMIT_RTPRIO", "n"), "LimitRTTIME": ("RLIMIT_RTTIME", "usec"),
}
APPLIED |= set(RLIMITS)

# Linux capabilities by name (capability.h), for CapabilityBoundingSet=.
CAPS = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
    "CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW",
    "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ",
    "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
]

# namespace-util.c's namespace_info, in its order.
NAMESPACES = [
    ("cgroup", 0x02000000), ("ipc", 0x08000000), ("net", 0x40000000), ("mnt", 0x00020000),
    ("pid", 0x20000000), ("user", 0x10000000), ("uts", 0x04000000), ("time", 0x00000080),
]
NAMESPACE_FLAGS_ALL = sum(f for n, f in NAMESPACES if n != "time")

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC = 32, 4096, 8192, 16384
MS_PRIVATE, MS_SLAVE, MS_SHARED, MS_STRICTATIME = 1 << 18, 1 << 19, 1 << 20, 1 << 24
MNT_DETACH = 2
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NOEXEC = 0x1, 0x2, 0x8
AT_FDCWD, AT_SYMLINK_NOFOLLOW, AT_RECURSIVE = -100, 0x100, 0x8000
SYS_MOUNT_SETATTR = 442  # x86_64
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
PROT_WRITE, PROT_EXEC, SHM_EXEC = 0x2, 0x4, 0o100000
O_CREAT = 0o100

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.unshare.argtypes = [ctypes.c_int]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
libc.syscall.restype = ctypes.c_long


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


class SetupError(Exception):
    """A set-up step failed: systemd would not start the unit (exit status `code`)."""

    def __init__(self, code, msg):
        super().__init__(msg)
        self.code = code


def say(msg):
    print(f"unit-sandbox: {msg}", file=sys.stderr, flush=True)


def oserr(what):
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


def c_mount(src, tgt, fstype, flags, data=None):
    enc = lambda s: s.encode() if isinstance(s, str) else s  # noqa: E731
    if libc.mount(enc(src), enc(tgt), enc(fstype), flags, enc(data)) != 0:
        raise oserr(f"mount {src} on {tgt}")


def c_umount(tgt, flags=MNT_DETACH):
    if libc.umount2(tgt.encode(), flags) != 0:
        raise oserr(f"umount {tgt}")


def c_unshare(flags):
    if libc.unshare(flags) != 0:
        raise oserr(f"unshare {flags:#x}")


def c_prctl(op, a=0, b=0, c=0, d=0):
    if libc.prctl(op, a, b, c, d) != 0:
        raise oserr(f"prctl {op}")


def mount_setattr(path, set_=0, clr=0, recursive=False):
    attr = MountAttr(set_, clr, 0, 0)
    flags = AT_SYMLINK_NOFOLLOW | (AT_RECURSIVE if recursive else 0)
    r = libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), path.encode(),
                     ctypes.c_uint(flags), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    if r != 0:
        raise oserr(f"mount_setattr {path}")


# ---------------------------------------------------------------------------------------------
# Unit files.

def unescape_instance(s):
    # unit_name_path_unescape: "-" is "/", \xNN an escaped byte.
    s = s.replace("-", "/")
    return re.sub(r"\\x([0-9a-fA-F]{2})", lambda m: chr(int(m.group(1), 16)), s)


class Unit:
    def __init__(self, name):
        self.name = name if "." in name else name + ".service"
        base = self.name[: -len(".service")]
        self.prefix, _, self.instance = base.partition("@")
        self.template = f"{self.prefix}@.service" if "@" in base else None
        self.settings = []  # (key, value, "file:line")
        self.files = []

    def specifiers(self, value, where):
        def rep(m):
            c = m.group(1)
            table = {
                "%": "%", "n": self.name, "N": self.name[: -len(".service")], "p": self.prefix,
                "P": unescape_instance(self.prefix), "i": self.instance,
                "I": unescape_instance(self.instance), "t": "/run", "S": "/var/lib",
                "C": "/var/cache", "L": "/var/log", "E": "/etc", "T": "/tmp", "V": "/var/tmp",
                "H": socket.gethostname(), "h": "/root", "u": "root", "U": "0",
            }
            if c not in table:
                raise SetupError(2, f"{where}: specifier %{c} is not supported by this runner")
            return table[c]
        return re.sub(r"%(.)", rep, value)


def read_unit_file(path):
    """[Service] assignments of one file: (key, value, where), continuation lines joined."""
    out, section, pending, start = [], None, None, 0
    with open(path) as f:
        lines = f.read().split("\n")
    for n, raw in enumerate(lines, 1):
        line = raw.strip() if pending is None else raw
        if pending is None:
            if not line or line[0] in "#;":
                continue
            if line.startswith("["):
                section = line.strip("[]")
                continue
            start = n
        else:
            if raw.strip()[:1] in ("#", ";"):
                continue  # comments inside a continued line are skipped
            line = pending + " " + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        pending = None
        if section != "Service" or "=" not in line:
            continue
        key, value = line.split("=", 1)
        out.append((key.strip(), value.strip(), f"{path}:{start}"))
    return out


def find_unit(unit, unit_file):
    if unit_file:
        return unit_file
    names = [unit.name] + ([unit.template] if unit.template else [])
    for n in names:
        for d in UNIT_DIRS:
            p = os.path.join(d, n)
            if os.path.exists(p):
                return p
    raise SetupError(2, f"unit {unit.name} not found in {', '.join(UNIT_DIRS)}")


def dropin_names(unit, main_file):
    names = [unit.name]
    # Aliases (symlinks in the unit directories to the same file) have drop-ins too.
    real = os.path.realpath(main_file)
    for d in UNIT_DIRS:
        for e in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            p = os.path.join(d, e)
            if e.endswith(".service") and e not in names and os.path.islink(p) and os.path.realpath(p) == real:
                names.append(e)
    if unit.template:
        names.append(unit.template)
    # Dash prefixes: foo-bar-baz.service also reads foo-bar-.service.d and foo-.service.d.
    base = unit.name[: -len(".service")]
    parts = base.split("-")
    for i in range(len(parts) - 1, 0, -1):
        names.append("-".join(parts[:i]) + "-.service")
    names.append("service")  # service.d/: every service
    return [n + ".d" for n in names]


def load(unit_name, unit_file, extra_dirs, sets):
    unit = Unit(unit_name)
    main = find_unit(unit, unit_file)
    unit.files.append(main)
    unit.settings += read_unit_file(main)
    chosen = {}
    for d in list(extra_dirs) + UNIT_DIRS:
        for sub in ([""] if d in extra_dirs else dropin_names(unit, main)):
            dd = os.path.join(d, sub) if sub else d
            if not os.path.isdir(dd):
                continue
            for e in sorted(os.listdir(dd)):
                if e.endswith(".conf") and e not in chosen:
                    chosen[e] = os.path.join(dd, e)
    for e in sorted(chosen):
        unit.files.append(chosen[e])
        unit.settings += read_unit_file(chosen[e])
    for i, s in enumerate(sets):
        if "=" not in s:
            raise SetupError(2, f"--set {s!r}: expected Key=Value")
        k, v = s.split("=", 1)
        unit.settings.append((k.strip(), v.strip(), f"--set #{i + 1}"))
    unit.settings = [(ALIASES.get(k, k), unit.specifiers(v, w), w) for k, v, w in unit.settings]
    return unit


class Settings:
    """Effective values: last assignment for scalars, accumulated lists (empty resets)."""

    def __init__(self, unit):
        self.raw = unit.settings
        self.scalar, self.lists, self.seen = {}, {}, {}
        for k, v, w in self.raw:
            self.seen.setdefault(k, []).append((v, w))
            if k in LIST_SETTINGS:
                if v == "":
                    self.lists[k] = []
                else:
                    self.lists.setdefault(k, []).extend(split_words(v))
            else:
                self.scalar[k] = v

    def get(self, k, default=None):
        v = self.scalar.get(k, default)
        return default if v == "" else v

    def bool(self, k, default=False):
        v = self.get(k)
        if v is None:
            return default
        return parse_bool(v, k)

    def list(self, k):
        return self.lists.get(k, [])


def parse_bool(v, what):
    lv = v.lower()
    if lv in ("1", "yes", "true", "on", "y", "t"):
        return True
    if lv in ("0", "no", "false", "off", "n", "f"):
        return False
    raise SetupError(2, f"{what}={v}: not a boolean")


def split_words(v):
    # extract_first_word with quotes and C escapes, as systemd splits list values.
    import shlex
    try:
        return shlex.split(v, posix=True)
    except ValueError as e:
        raise SetupError(2, f"cannot split {v!r}: {e}")


# ---------------------------------------------------------------------------------------------
# The plan: everything computed before anything is changed.

class Plan:
    def __init__(self, unit, s, cmd):
        self.unit, self.s, self.cmd = unit, s, cmd
        self.not_applied, self.manager_only = [], []
        self.classify()
        self.user = self.group = None
        self.uid = self.gid = None
        self.home, self.shell = "/root", None
        self.resolve_user()
        self.rlimits = self.compute_rlimits()
        self.exec_dirs = self.compute_exec_dirs()
        self.env = None  # computed after the exec dirs exist

    def classify(self):
        for k, vals in self.s.seen.items():
            if k in APPLIED:
                continue
            if k in MANAGER_ONLY:
                self.manager_only.append(k)
                continue
            why = {
                "TasksMax": "cgroup pids limit: the runner makes no cgroup",
                "MemoryMax": "cgroup memory limit: the runner makes no cgroup",
                "MemoryLimit": "cgroup memory limit: the runner makes no cgroup",
                "CPUQuota": "cgroup CPU limit: the runner makes no cgroup",
                "DeviceAllow": "cgroup device policy: the runner makes no cgroup",
                "DevicePolicy": "cgroup device policy: the runner makes no cgroup",
                "IPAddressDeny": "cgroup BPF firewall: the runner makes no cgroup",
                "IPAddressAllow": "cgroup BPF firewall: the runner makes no cgroup",
                "RestrictFileSystems": "LSM BPF: not in this runner",
                "DynamicUser": "dynamic users: not in this runner",
                "RootDirectory": "RootDirectory/RootImage: not in this runner",
                "RemoveIPC": "done by the manager when the unit stops: nothing stops it here",
                "RuntimeDirectoryPreserve": "removal at stop: the runner execs the command, nothing is left to remove the directory",
                "StandardOutput": "output goes where the runner's goes (no journal)",
                "StandardError": "output goes where the runner's goes (no journal)",
                "StandardInput": "input is the runner's",
                "AmbientCapabilities": "not in this runner",
                "SecureBits": "not in this runner",
            }.get(k, "not implemented by this runner")
            self.not_applied.append({"setting": k, "values": [v for v, _ in vals], "why": why})
        # Not in the unit but applied by systemd to every service: say so.
        self.not_applied.append({
            "setting": "DefaultTasksMax (system.conf)", "values": ["15%"],
            "why": "cgroup pids limit of every service: the runner makes no cgroup",
        })

    def resolve_user(self):
        u, g = self.s.get("User"), self.s.get("Group")
        if u is not None:
            try:
                pw = pwd.getpwnam(u) if not u.isdigit() else pwd.getpwuid(int(u))
            except KeyError:
                raise SetupError(EXIT["user"], f"User={u}: no such user")
            self.user, self.uid, self.gid = pw.pw_name, pw.pw_uid, pw.pw_gid
            self.home, self.shell = pw.pw_dir, pw.pw_shell
        if g is not None:
            try:
                gr = grp.getgrnam(g) if not g.isdigit() else grp.getgrgid(int(g))
            except KeyError:
                raise SetupError(EXIT["group"], f"Group={g}: no such group")
            self.gid = gr.gr_gid
        self.supplementary = []
        for g in self.s.list("SupplementaryGroups"):
            try:
                self.supplementary.append(grp.getgrnam(g).gr_gid if not g.isdigit() else int(g))
            except KeyError:
                raise SetupError(EXIT["group"], f"SupplementaryGroups={g}: no such group")

    def compute_rlimits(self):
        limits = {}
        # The manager's defaults (system.conf and its drop-ins), then the unit's.
        defaults = {"LimitNOFILE": "1024:524288", "LimitMEMLOCK": "8M"}
        confs = ["/etc/systemd/system.conf"] + sorted(
            os.path.join("/etc/systemd/system.conf.d", e)
            for e in (os.listdir("/etc/systemd/system.conf.d") if os.path.isdir("/etc/systemd/system.conf.d") else [])
            if e.endswith(".conf"))
        for c in confs:
            if not os.path.isfile(c):
                continue
            for line in open(c):
                m = re.match(r"\s*DefaultLimit([A-Z]+)\s*=\s*(.*?)\s*$", line)
                if m:
                    defaults["Limit" + m.group(1)] = m.group(2)
        for k, v in list(defaults.items()) + [(k, self.s.get(k)) for k in RLIMITS]:
            if v is None or v == "" or k not in RLIMITS:
                continue
            name, kind = RLIMITS[k]
            soft, _, hard = v.partition(":")
            if not hard:
                hard = soft
            limits[name] = (parse_limit(soft, kind, k), parse_limit(hard, kind, k))
        return limits

    def compute_exec_dirs(self):
        dirs = []
        for key, base, env, code in [
            ("RuntimeDirectory", "/run", "RUNTIME_DIRECTORY", EXIT["runtime_directory"]),
            ("StateDirectory", "/var/lib", "STATE_DIRECTORY", EXIT["state_directory"]),
            ("CacheDirectory", "/var/cache", "CACHE_DIRECTORY", EXIT["cache_directory"]),
            ("LogsDirectory", "/var/log", "LOGS_DIRECTORY", EXIT["logs_directory"]),
            ("ConfigurationDirectory", "/etc", "CONFIGURATION_DIRECTORY", EXIT["configuration_directory"]),
        ]:
            mode = int(self.s.get(key + "Mode", "0755"), 8)
            for d in self.s.list(key):
                d = d.split(":", 1)[0]  # a ":symlink" suffix is not supported; the directory is
                if d.startswith("/") or ".." in d.split("/"):
                    raise SetupError(code, f"{key}={d}: must be relative")
                dirs.append((key, os.path.join(base, d), mode, env, code))
        return dirs


def parse_limit(v, kind, what):
    v = v.strip()
    if v == "infinity":
        return resource.RLIM_INFINITY
    try:
        if kind == "bytes":
            m = re.fullmatch(r"(\d+)\s*([KMGTPE]?)i?B?", v, re.I)
            mult = 1024 ** "BKMGTPE".index((m.group(2) or "B").upper())
            return int(m.group(1)) * mult
        if kind in ("sec", "usec"):
            m = re.fullmatch(r"(\d+)\s*(us|usec|ms|msec|s|sec|min|h|d)?", v)
            unit = m.group(2) or ("s" if kind == "sec" else "us")
            us = int(m.group(1)) * {"us": 1, "usec": 1, "ms": 1000, "msec": 1000, "s": 10**6,
                                    "sec": 10**6, "min": 60 * 10**6, "h": 3600 * 10**6,
                                    "d": 86400 * 10**6}[unit]
            return -(-us // 10**6) if kind == "sec" else us
        if kind == "nice":
            if v[0] in "+-":
                return 20 - int(v)
            return int(v)
        return int(v)
    except (AttributeError, ValueError):
        raise SetupError(EXIT["limits"], f"{what}={v}: cannot parse")


# ---------------------------------------------------------------------------------------------
# Environment (exec_child: the manager's, then ours, then Environment=, EnvironmentFile=).

def read_env_file(path):
    out = []
    text = open(path).read()
    text = re.sub(r"\\\n", "", text)
    for line in text.split("\n"):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if "=" not in line:
            continue
        k, v = line.split("=", 1)
        k, v = k.strip(), v.strip()
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "\"'":
            v = v[1:-1]
        out.append((k, v))
    return out


def build_env(plan):
    s = plan.s
    env = {"PATH": DEFAULT_PATH}
    lang = "C.UTF-8"
    for f in ("/etc/locale.conf", "/etc/default/locale"):
        if os.path.isfile(f):
            for k, v in read_env_file(f):
                if k == "LANG":
                    lang = v
            break
    env["LANG"] = lang
    if plan.user is not None:
        env.update({"HOME": plan.home, "LOGNAME": plan.user, "USER": plan.user})
        if plan.shell:
            env["SHELL"] = plan.shell
    by_env = {}
    for key, path, mode, var, code in plan.exec_dirs:
        by_env.setdefault(var, []).append(path)
    for var, paths in by_env.items():
        env[var] = ":".join(paths)
    for k in s.list("PassEnvironment"):
        if k in os.environ:
            env[k] = os.environ[k]
    for w in s.list("Environment"):
        if "=" in w:
            k, v = w.split("=", 1)
            env[k] = v
    for f in s.list("EnvironmentFile"):
        optional = f.startswith("-")
        f = f.lstrip("-")
        if not os.path.isfile(f):
            if optional:
                continue
            raise SetupError(EXIT["exec"], f"EnvironmentFile={f}: not found")
        for k, v in read_env_file(f):
            env[k] = v
    for k in s.list("UnsetEnvironment"):
        if "=" in k:
            if env.get(k.split("=", 1)[0]) == k.split("=", 1)[1]:
                del env[k.split("=", 1)[0]]
        else:
            env.pop(k, None)
    return env


# ---------------------------------------------------------------------------------------------
# The mount namespace (namespace.c).

MODES = ["INACCESSIBLE", "OVERLAY_MOUNT", "MOUNT_IMAGES", "BIND_MOUNT", "BIND_MOUNT_RECURSIVE",
         "PRIVATE_TMP", "PRIVATE_TMP_READONLY", "PRIVATE_DEV", "BIND_DEV", "EMPTY_DIR", "SYSFS",
         "PROCFS", "READONLY", "READWRITE", "NOEXEC", "EXEC", "TMPFS", "RUN",
         "EXTENSION_DIRECTORIES", "EXTENSION_IMAGES", "MQUEUEFS", "READWRITE_IMPLICIT"]
PRIO = {m: i for i, m in enumerate(MODES)}


class Entry:
    def __init__(self, path, mode, ignore=False, source=None, read_only=False, options=None,
                 flags=0, rbind=True):
        self.path, self.mode, self.ignore, self.source = path, mode, ignore, source
        self.read_only, self.noexec, self.exec = read_only, False, False
        self.options, self.flags, self.rbind = options, flags, rbind
        self.skipped = False

    def is_read_only(self):
        return self.read_only or self.mode in ("READONLY", "INACCESSIBLE", "PRIVATE_TMP_READONLY")

    def is_noexec(self):
        return self.noexec or self.mode in ("NOEXEC", "INACCESSIBLE", "SYSFS", "PROCFS")

    def is_exec(self):
        return self.exec or self.mode == "EXEC"

    def __repr__(self):
        extra = "".join([" ro" if self.is_read_only() else "", " noexec" if self.is_noexec() else "",
                         " exec" if self.is_exec() else "", " (if present)" if self.ignore else "",
                         f" from {self.source}" if self.source else ""])
        return f"{self.path} {self.mode.lower()}{extra}"


PROTECT_KERNEL_TUNABLES_PROC = [
    ("/proc/acpi", "READONLY"), ("/proc/apm", "READONLY"), ("/proc/asound", "READONLY"),
    ("/proc/bus", "READONLY"), ("/proc/fs", "READONLY"), ("/proc/irq", "READONLY"),
    ("/proc/kallsyms", "INACCESSIBLE"), ("/proc/kcore", "INACCESSIBLE"),
    ("/proc/latency_stats", "READONLY"), ("/proc/mtrr", "READONLY"), ("/proc/scsi", "READONLY"),
    ("/proc/sys", "READONLY"), ("/proc/sysrq-trigger", "READONLY"), ("/proc/timer_stats", "READONLY"),
]
PROTECT_KERNEL_TUNABLES_SYS = [
    ("/sys", "READONLY", False), ("/sys/fs/bpf", "READONLY", True),
    ("/sys/fs/cgroup", "READWRITE_IMPLICIT", False), ("/sys/fs/selinux", "READWRITE_IMPLICIT", True),
    ("/sys/kernel/debug", "READONLY", True), ("/sys/kernel/tracing", "READONLY", True),
]
SPLIT_USR = ["/lib", "/lib64", "/bin", "/sbin"]


def access_entries(paths, mode):
    out = []
    for p in paths:
        ignore = p.startswith("-")
        p = p.lstrip("-")
        if p.startswith("+"):
            p = p[1:]  # relative to RootDirectory=, which this runner does not support: the host's root
        if not p.startswith("/"):
            raise SetupError(EXIT["namespace"], f"path is not absolute: {p}")
        out.append(Entry(p, mode, ignore=ignore))
    return out


def needs_mount_namespace(plan):
    s = plan.s
    return bool(
        any(s.list(k) for k in ("ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths", "ExecPaths",
                                "NoExecPaths", "BindPaths", "BindReadOnlyPaths", "TemporaryFileSystem"))
        or s.bool("PrivateTmp") or s.bool("PrivateDevices") or s.bool("PrivateMounts")
        or s.get("ProtectSystem", "no") not in ("no", "false", "0", "off")
        or s.get("ProtectHome", "no") not in ("no", "false", "0", "off")
        or s.bool("ProtectKernelTunables") or s.bool("ProtectKernelModules")
        or s.bool("ProtectKernelLogs") or s.bool("ProtectControlGroups")
        or s.get("ProtectProc", "default") != "default" or s.get("ProcSubset", "all") != "all"
        or s.bool("PrivateIPC"))


def mount_entries(plan):
    s = plan.s
    m = []
    m += access_entries(s.list("ReadWritePaths"), "READWRITE")
    m += access_entries(s.list("ReadOnlyPaths"), "READONLY")
    m += access_entries(s.list("InaccessiblePaths"), "INACCESSIBLE")
    m += access_entries(s.list("ExecPaths"), "EXEC")
    m += access_entries(s.list("NoExecPaths"), "NOEXEC")
    for key, ro in (("BindPaths", False), ("BindReadOnlyPaths", True)):
        for b in s.list(key):
            ignore = b.startswith("-")
            b = b.lstrip("-")
            parts = b.split(":")
            src, dst = parts[0], parts[1] if len(parts) > 1 and parts[1] else parts[0]
            rbind = not (len(parts) > 2 and parts[2] == "norbind")
            m.append(Entry(dst, "BIND_MOUNT_RECURSIVE" if rbind else "BIND_MOUNT", ignore=ignore,
                           source=src, read_only=ro, rbind=rbind))
    for t in s.list("TemporaryFileSystem"):
        path, _, opts = t.partition(":")
        ro = "ro" in opts.split(",")
        opts = ",".join(o for o in opts.split(",") if o and o not in ("ro", "rw"))
        m.append(Entry(path, "TMPFS", read_only=ro, options="mode=0755" + ("," + opts if opts else ""),
                       flags=MS_NODEV | MS_STRICTATIME))
    # The exec directories, bound onto themselves (compile_bind_mounts): writable under
    # ProtectSystem=strict.
    for key, path, mode, var, code in plan.exec_dirs:
        m.append(Entry(path, "BIND_MOUNT_RECURSIVE", source=path))
    if s.bool("PrivateTmp"):
        m.append(Entry("/tmp", "PRIVATE_TMP"))
        m.append(Entry("/var/tmp", "PRIVATE_TMP"))
    if s.bool("PrivateDevices"):
        m.append(Entry("/dev", "PRIVATE_DEV"))
    if s.bool("ProtectKernelTunables"):
        m += [Entry(p, mode, ignore=True) for p, mode in PROTECT_KERNEL_TUNABLES_PROC]
        m += [Entry(p, mode, ignore=ign) for p, mode, ign in PROTECT_KERNEL_TUNABLES_SYS]
    if s.bool("ProtectKernelModules"):
        m += [Entry("/lib/modules", "INACCESSIBLE", ignore=True), Entry("/usr/lib/modules", "INACCESSIBLE", ignore=True)]
    if s.bool("ProtectKernelLogs"):
        m += [Entry("/proc/kmsg", "INACCESSIBLE", ignore=True), Entry("/dev/kmsg", "INACCESSIBLE", ignore=True)]
    if s.bool("ProtectControlGroups"):
        m.append(Entry("/sys/fs/cgroup", "READONLY"))
    home = s.get("ProtectHome", "no")
    if home in ("yes", "true", "1", "on"):
        m += [Entry(p, "INACCESSIBLE", ignore=True) for p in ("/home", "/run/user", "/root")]
    elif home == "read-only":
        m += [Entry(p, "READONLY", ignore=True) for p in ("/home", "/run/user", "/root")]
    elif home == "tmpfs":
        m += [Entry(p, "TMPFS", ignore=True, read_only=True, options="mode=0755" if p != "/root" else "mode=0700",
                    flags=MS_NODEV | MS_STRICTATIME) for p in ("/home", "/run/user", "/root")]
    elif home not in ("no", "false", "0", "off"):
        raise SetupError(2, f"ProtectHome={home}: unknown value")
    system = s.get("ProtectSystem", "no")
    if system in ("yes", "true", "1", "on", "full"):
        m += [Entry("/usr", "READONLY"), Entry("/boot", "READONLY", ignore=True), Entry("/efi", "READONLY", ignore=True)]
        if system == "full":
            m.append(Entry("/etc", "READONLY"))
        m += [Entry(p, "READONLY", ignore=True) for p in SPLIT_USR]
    elif system == "strict":
        m += [Entry("/", "READONLY"), Entry("/proc", "READWRITE_IMPLICIT"), Entry("/sys", "READWRITE_IMPLICIT"),
              Entry("/dev", "READWRITE_IMPLICIT")]
        m += [Entry(p, "READWRITE_IMPLICIT", ignore=True) for p in ("/home", "/run/user", "/root")]
    elif system not in ("no", "false", "0", "off"):
        raise SetupError(2, f"ProtectSystem={system}: unknown value")
    proc = s.get("ProtectProc", "default")
    subset = s.get("ProcSubset", "all")
    if (s.bool("ProtectKernelTunables") or s.bool("ProtectControlGroups") or proc != "default"
            or subset != "all" or s.bool("MountAPIVFS")):
        m += [Entry("/proc", "PROCFS"), Entry("/dev", "BIND_DEV"), Entry("/sys", "SYSFS"),
              Entry("/run", "RUN")]
    if s.bool("ProtectHostname"):
        m += [Entry("/proc/sys/kernel/hostname", "READONLY"), Entry("/proc/sys/kernel/domainname", "READONLY")]
    if s.bool("PrivateIPC"):
        m.append(Entry("/dev/mqueue", "MQUEUEFS"))
    m.append(Entry("/run/credentials", "INACCESSIBLE", ignore=True))
    return normalize(m)


def normalize(m):
    # follow_symlink (all at once: these paths do not move under our own mounts), then
    # drop_unused_mounts: sort, drop duplicates (merging flags), drop what an inaccessible
    # parent hides, drop entries whose nearest parent entry has the same mode.
    for e in m:
        e.path = os.path.realpath(e.path)
    m.sort(key=lambda e: (path_key(e.path), PRIO[e.mode]))
    out = []
    for e in m:
        if out and out[-1].path == e.path:
            p = out[-1]
            p.read_only = p.read_only or e.is_read_only()
            p.noexec = p.noexec or e.is_noexec()
            p.exec = p.exec or e.is_exec()
            continue
        out.append(e)
    kept, clear = [], None
    for e in out:
        if clear is not None and under(e.path, clear):
            continue
        clear = e.path if e.mode == "INACCESSIBLE" else None
        kept.append(e)
    final = []
    for e in kept:
        if e.mode in ("READONLY", "READWRITE", "READWRITE_IMPLICIT"):
            parent = next((p for p in reversed(final) if under(e.path, p.path)), None)
            if parent is not None and parent.mode == e.mode:
                continue
        final.append(e)
    return final


def path_key(p):
    return [c for c in p.split("/") if c]


def under(path, prefix):
    return prefix == "/" or path == prefix or path.startswith(prefix.rstrip("/") + "/")


def unescape_mountinfo(s):
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def mount_points():
    out = []
    for line in open("/proc/self/mountinfo"):
        out.append(unescape_mountinfo(line.split()[4]))
    return out


def is_mount_point(path):
    return path in set(mount_points())


def remount_tree(prefix, set_, clr, deny):
    """bind_remount_recursive(): `prefix` (made a mount point first if it is not one) and the
    mounts below it, except those at or below another entry's path (`deny`), which that entry
    handles. Failures on submounts are ignored, as systemd ignores them."""
    if not os.path.lexists(prefix):
        raise FileNotFoundError(errno.ENOENT, f"{prefix}: No such file or directory")
    if not is_mount_point(prefix):
        c_mount(prefix, prefix, None, MS_BIND | MS_REC)
    others = [d for d in deny if d != prefix and under(d, prefix)]
    done = set()
    for mp in mount_points():
        if mp in done or not under(mp, prefix):
            continue
        if mp != prefix and any(under(mp, d) for d in others):
            continue
        done.add(mp)
        try:
            mount_setattr(mp, set_, clr)
        except OSError:
            if mp == prefix:
                raise


class Inaccessible:
    """The inaccessible nodes systemd keeps in /run/systemd/inaccessible, in a tmpfs of our own."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="unit-sandbox-inaccessible-", dir="/run")
        c_mount("tmpfs", self.dir, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
        os.mkdir(os.path.join(self.dir, "dir"), 0)
        os.mknod(os.path.join(self.dir, "reg"), stat.S_IFREG | 0)
        os.mknod(os.path.join(self.dir, "fifo"), stat.S_IFIFO | 0)
        os.mknod(os.path.join(self.dir, "chr"), stat.S_IFCHR | 0, os.makedev(0, 0))
        os.mknod(os.path.join(self.dir, "blk"), stat.S_IFBLK | 0, os.makedev(0, 0))
        for n in ("dir", "reg", "fifo", "chr", "blk"):
            os.chmod(os.path.join(self.dir, n), 0)

    def node(self, mode):
        for test, n in ((stat.S_ISDIR, "dir"), (stat.S_ISREG, "reg"), (stat.S_ISFIFO, "fifo"),
                        (stat.S_ISCHR, "chr"), (stat.S_ISBLK, "blk"), (stat.S_ISSOCK, "reg")):
            if test(mode):
                return os.path.join(self.dir, n)
        raise SetupError(EXIT["namespace"], "file type not supported for inaccessible mounts")

    def close(self):
        c_umount(self.dir)
        os.rmdir(self.dir)


def umount_recursive(path):
    for mp in sorted((p for p in mount_points() if under(p, path)), key=len, reverse=True):
        try:
            c_umount(mp)
        except OSError:
            pass


def private_dev(entry):
    tmp = tempfile.mkdtemp(prefix="namespace-dev-", dir="/tmp")
    dev = os.path.join(tmp, "dev")
    os.mkdir(dev, 0o755)
    c_mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_STRICTATIME | MS_NOEXEC, "mode=755,size=4m,nr_inodes=64k")
    os.mkdir(dev + "/pts", 0o755)
    c_mount("/dev/pts", dev + "/pts", None, MS_BIND)
    if os.path.islink("/dev/ptmx"):
        os.symlink("pts/ptmx", dev + "/ptmx")
    else:
        clone_device_node("/dev/ptmx", dev)
    # systemd 252 binds the host's /dev/shm here: POSIX shared memory is not private.
    os.mkdir(dev + "/shm", 0o755)
    c_mount("/dev/shm", dev + "/shm", None, MS_BIND)
    for d in ("mqueue", "hugepages"):
        os.mkdir(f"{dev}/{d}", 0o755)
        try:
            c_mount(f"/dev/{d}", f"{dev}/{d}", None, MS_BIND)
        except OSError:
            pass
    os.symlink("/run/systemd/journal/dev-log", dev + "/log")
    for d in ("null", "zero", "full", "random", "urandom", "tty"):
        if os.path.exists("/dev/" + d):
            clone_device_node("/dev/" + d, dev)
    # dev_setup(): the standard symlinks.
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    if os.path.exists("/proc/kcore"):
        os.symlink("/proc/kcore", dev + "/core")
    umount_recursive(entry.path)
    c_mount(dev, entry.path, None, MS_MOVE)
    os.rmdir(dev)
    os.rmdir(tmp)


def clone_device_node(src, dev):
    st = os.stat(src)
    dst = dev + src[len("/dev"):]
    os.mknod(dst, st.st_mode, st.st_rdev)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.chown(dst, st.st_uid, st.st_gid)
    kind = "char" if stat.S_ISCHR(st.st_mode) else "block"
    os.makedirs(f"{dev}/{kind}", 0o755, exist_ok=True)
    try:
        os.symlink("../" + src[len("/dev/"):], f"{dev}/{kind}/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
    except OSError:
        pass


def make_mount_point_inode(src, dst):
    os.makedirs(os.path.dirname(dst), 0o755, exist_ok=True)
    if os.path.isdir(src):
        os.makedirs(dst, 0o755, exist_ok=True)
    elif not os.path.exists(dst):
        os.close(os.open(dst, os.O_CREAT | os.O_WRONLY, 0o644))  # mode & ~0111, as systemd


def apply_one(e, plan, inacc):
    mode = e.mode
    if mode == "INACCESSIBLE":
        umount_recursive(e.path)
        try:
            st = os.lstat(e.path)
        except FileNotFoundError:
            if e.ignore:
                e.skipped = True
                return
            raise SetupError(EXIT["namespace"], f"{e.path}: No such file or directory")
        c_mount(inacc.node(st.st_mode), e.path, None, MS_BIND)
        return
    if mode in ("READONLY", "READWRITE", "READWRITE_IMPLICIT", "EXEC", "NOEXEC"):
        if not os.path.lexists(e.path):
            if e.ignore:
                e.skipped = True
                return
            raise SetupError(EXIT["namespace"], f"{e.path}: No such file or directory")
        if not is_mount_point(e.path):
            c_mount(e.path, e.path, None, MS_BIND | MS_REC)
        return
    if mode in ("BIND_MOUNT", "BIND_MOUNT_RECURSIVE"):
        src = os.path.realpath(e.source)
        if not os.path.exists(src):
            if e.ignore:
                e.skipped = True
                return
            raise SetupError(EXIT["namespace"], f"Failed to mount {e.source} to {e.path}: No such file or directory")
        if not os.path.lexists(e.path):
            make_mount_point_inode(src, e.path)
        c_mount(src, e.path, None, MS_BIND | (MS_REC if e.rbind else 0))
        return
    if mode in ("TMPFS", "EMPTY_DIR"):
        os.makedirs(e.path, 0o755, exist_ok=True)
        umount_recursive(e.path)
        c_mount("tmpfs", e.path, "tmpfs", e.flags, e.options)
        return
    if mode == "PRIVATE_TMP":
        # A tmpfs where systemd binds /tmp/systemd-private-*-UNIT-*/tmp: as private to the
        # unit, and gone with it (systemd deletes its directory at stop).
        c_mount("tmpfs", e.path, "tmpfs", 0, "mode=1777")
        return
    if mode == "PRIVATE_DEV":
        private_dev(e)
        return
    if mode in ("BIND_DEV", "SYSFS"):
        return  # /dev and /sys are mount points already: nothing to do (as systemd)
    if mode == "RUN":
        # On a systemd host /run is always a tmpfs mount point, so systemd does nothing here;
        # a test machine's /run may be a plain directory, which must not be hidden.
        return
    if mode == "PROCFS":
        proc = plan.s.get("ProtectProc", "default")
        subset = plan.s.get("ProcSubset", "all")
        opts = []
        if proc != "default" or subset != "all":
            opts.append("hidepid=" + ("off" if proc == "default" else proc))
            if subset == "pid":
                opts.append("subset=pid")
        umount_recursive("/proc")
        c_mount("proc", "/proc", "proc", MS_NOSUID | MS_NOEXEC | MS_NODEV, ",".join(opts) or None)
        return
    if mode == "MQUEUEFS":
        os.makedirs(e.path, 0o755, exist_ok=True)
        umount_recursive(e.path)
        c_mount("mqueue", e.path, "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        return
    raise SetupError(EXIT["namespace"], f"mount mode {mode} not implemented")


def setup_mount_namespace(plan):
    entries = mount_entries(plan)
    plan.mounts = entries
    c_unshare(CLONE_NEWNS)
    c_mount(None, "/", None, MS_SLAVE | MS_REC)
    inacc = Inaccessible()
    try:
        for e in entries:
            apply_one(e, plan, inacc)
    finally:
        inacc.close()
    live = [e for e in entries if not e.skipped]

    def flip(e, set_, clr, deny, submounts):
        try:
            if submounts:
                remount_tree(e.path, set_, clr, deny)
            else:
                mount_setattr(e.path, set_, clr)
        except FileNotFoundError:
            if not e.ignore:
                raise

    # make_read_only(), make_noexec(), make_nosuid(): each entry's flags on its mount and the
    # submounts no other entry covers.
    deny = [e.path for e in live]
    for e in live:
        if e.is_read_only() or e.mode == "PRIVATE_DEV":
            flip(e, MOUNT_ATTR_RDONLY, 0, deny, e.is_read_only() and e.mode not in ("EMPTY_DIR", "TMPFS"))
    deny = [e.path for e in live if e.mode in ("EXEC", "NOEXEC")]
    for e in live:
        if e.is_noexec():
            flip(e, MOUNT_ATTR_NOEXEC, 0, deny, e.mode not in ("EMPTY_DIR", "TMPFS"))
        elif e.is_exec():
            flip(e, 0, MOUNT_ATTR_NOEXEC, deny, e.mode not in ("EMPTY_DIR", "TMPFS"))
    if plan.s.bool("NoNewPrivileges"):
        # With NNP on, setuid bits have no effect anyway: systemd sets MS_NOSUID everywhere.
        for e in live:
            flip(e, MOUNT_ATTR_NOSUID, 0, [], e.mode not in ("EMPTY_DIR", "TMPFS"))
    # MountFlags= default: shared again (propagation to the host stays cut by the slave step).
    c_mount(None, "/", None, MS_SHARED | MS_REC)


# ---------------------------------------------------------------------------------------------
# Seccomp (seccomp-util.c), built before anything is changed and loaded just before exec.

def syscall_groups():
    out = subprocess.run(["systemd-analyze", "syscall-filter"], capture_output=True, text=True, check=True).stdout
    groups, cur = {}, None
    for line in out.split("\n"):
        if line.startswith("@"):
            cur = groups.setdefault(line.strip(), [])
        elif line.startswith("    ") and cur is not None and not line.strip().startswith("#"):
            cur.append(line.strip())
        elif not line.strip():
            cur = None
    return groups


def expand(name, groups, seen=None):
    seen = set() if seen is None else seen
    if not name.startswith("@"):
        return [name]
    if name not in groups:
        return []  # unknown group: ignored, as systemd (permissive) does
    if name in seen:
        return []
    seen.add(name)
    out = []
    for n in groups[name]:
        out += expand(n, groups, seen)
    return out


def resolve(name):
    nr = seccomp.resolve_syscall(seccomp.Arch.NATIVE, name)
    return None if nr == -1 else nr


def new_filter(default):
    f = seccomp.SyscallFilter(defaction=default)
    f.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.ALLOW)
    f.set_attr(seccomp.Attr.CTL_NNP, 0)
    return f


def add(f, action, nr, *args):
    try:
        f.add_rule_exactly(action, nr, *args)
    except RuntimeError:
        pass  # not a syscall of this architecture (EDOM), as systemd ignores it


def errno_value(v):
    if v.isdigit():
        return int(v)
    if v == "kill":
        return "kill"
    if not hasattr(errno, v):
        raise SetupError(2, f"unknown errno {v}")
    return getattr(errno, v)


def syscall_filter(plan, groups):
    """config_parse_syscall_filter, then apply_syscall_filter."""
    filt, allow_list, started = {}, False, False
    for v, where in plan.s.seen.get("SystemCallFilter", []):
        if v == "":
            filt, allow_list, started = {}, False, False
            continue
        invert = v.startswith("~")
        if invert:
            v = v[1:]
        if not started:
            started = True
            allow_list = not invert
            if allow_list:
                for n in expand("@default", groups):
                    nr = resolve(n)
                    if nr is not None:
                        filt[nr] = -1
        for word in split_words(v):
            name, _, err = word.partition(":")
            e = errno_value(err) if err else -1
            for n in expand(name, groups):
                nr = resolve(n)
                if nr is None:
                    continue
                if (not invert) == allow_list or (invert and allow_list and e != -1):
                    filt[nr] = e
                else:
                    filt.pop(nr, None)
    if not started:
        return None, None
    sce = plan.s.get("SystemCallErrorNumber")
    negative = seccomp.KILL_PROCESS if sce in (None, "kill") else seccomp.ERRNO(errno_value(sce))
    default, action = (negative, seccomp.ALLOW) if allow_list else (seccomp.ALLOW, negative)
    f = new_filter(default)
    for nr, e in filt.items():
        a = action
        if e == "kill":
            a = seccomp.KILL_PROCESS
        elif e != -1:
            a = seccomp.ERRNO(e)
        add(f, a, nr)
    desc = f"SystemCallFilter ({'allow' if allow_list else 'deny'}-list of {len(filt)} syscalls, others {'killed' if allow_list and sce in (None, 'kill') else 'allowed' if not allow_list else 'errno ' + sce})"
    return f, desc


def address_family_filter(plan):
    """config_parse_address_families, then seccomp_restrict_address_families."""
    fams, allow = None, False
    for v, where in plan.s.seen.get("RestrictAddressFamilies", []):
        if v == "":
            fams, allow = None, False
            continue
        if v == "none":
            fams, allow = None, True
            continue
        invert = v.startswith("~")
        if fams is None:
            fams, allow = set(), not invert
        for w in split_words(v[1:] if invert else v):
            if not w.startswith("AF_") or not hasattr(socket, w):
                raise SetupError(2, f"RestrictAddressFamilies: unknown family {w}")
            if (not invert) == allow:
                fams.add(int(getattr(socket, w)))
            else:
                fams.discard(int(getattr(socket, w)))
    fams = fams or set()
    if not allow and not fams:
        return None
    f = new_filter(seccomp.ALLOW)
    eaf = seccomp.ERRNO(errno.EAFNOSUPPORT)
    sock = resolve("socket")
    if allow:
        valid = sorted(a for a in fams if 0 < a < 46)  # AF_MAX
        if not valid:
            add(f, eaf, sock)
        else:
            first, last = valid[0], valid[-1]
            add(f, eaf, sock, seccomp.Arg(0, seccomp.LT, first))
            add(f, eaf, sock, seccomp.Arg(0, seccomp.GT, last))
            for af in range(first, last):
                if af not in fams:
                    add(f, eaf, sock, seccomp.Arg(0, seccomp.EQ, af))
    else:
        for af in fams:
            add(f, eaf, sock, seccomp.Arg(0, seccomp.EQ, af))
    names = sorted(n for n in dir(socket) if n.startswith("AF_") and int(getattr(socket, n)) in fams)
    return f, f"RestrictAddressFamilies ({'only' if allow else 'not'} {' '.join(names) or 'none'}; socket() of others: EAFNOSUPPORT)"


def simple_filters(plan, groups):
    """The filters exec_child loads before SystemCallFilter=, in its order."""
    s, out = plan.s, []
    eperm = seccomp.ERRNO(errno.EPERM)
    if s.bool("MemoryDenyWriteExecute"):
        f = new_filter(seccomp.ALLOW)
        add(f, eperm, resolve("mmap"), seccomp.Arg(2, seccomp.MASKED_EQ, PROT_EXEC | PROT_WRITE, PROT_EXEC | PROT_WRITE))
        add(f, eperm, resolve("mprotect"), seccomp.Arg(2, seccomp.MASKED_EQ, PROT_EXEC, PROT_EXEC))
        add(f, eperm, resolve("pkey_mprotect"), seccomp.Arg(2, seccomp.MASKED_EQ, PROT_EXEC, PROT_EXEC))
        add(f, eperm, resolve("shmat"), seccomp.Arg(2, seccomp.MASKED_EQ, SHM_EXEC, SHM_EXEC))
        out.append((f, "MemoryDenyWriteExecute (mmap W+X, mprotect/pkey_mprotect +X, shmat SHM_EXEC: EPERM)"))
    if s.bool("RestrictRealtime"):
        f = new_filter(seccomp.ALLOW)
        # SCHED_OTHER 0, BATCH 3, IDLE 5 allowed; FIFO 1, RR 2, 4 and >5 (DEADLINE 6) refused.
        for p in (1, 2, 4):
            add(f, eperm, resolve("sched_setscheduler"), seccomp.Arg(1, seccomp.EQ, p))
        add(f, eperm, resolve("sched_setscheduler"), seccomp.Arg(1, seccomp.GT, 5))
        out.append((f, "RestrictRealtime (sched_setscheduler FIFO/RR/DEADLINE: EPERM)"))
    if s.bool("RestrictSUIDSGID"):
        f = new_filter(seccomp.ALLOW)
        for m in (stat.S_ISUID, stat.S_ISGID):
            for name, arg in (("chmod", 1), ("fchmod", 1), ("fchmodat", 2), ("mkdir", 1), ("mkdirat", 2),
                              ("mknod", 1), ("mknodat", 2), ("creat", 1)):
                add(f, eperm, resolve(name), seccomp.Arg(arg, seccomp.MASKED_EQ, m, m))
            add(f, eperm, resolve("open"), seccomp.Arg(1, seccomp.MASKED_EQ, O_CREAT, O_CREAT),
                seccomp.Arg(2, seccomp.MASKED_EQ, m, m))
            add(f, eperm, resolve("openat"), seccomp.Arg(2, seccomp.MASKED_EQ, O_CREAT, O_CREAT),
                seccomp.Arg(3, seccomp.MASKED_EQ, m, m))
        add(f, seccomp.ERRNO(errno.ENOSYS), resolve("openat2"))
        out.append((f, "RestrictSUIDSGID (creating setuid/setgid files: EPERM; openat2: ENOSYS)"))
    retain = parse_namespaces(s.get("RestrictNamespaces"))
    if retain is not None and (retain & NAMESPACE_FLAGS_ALL) != NAMESPACE_FLAGS_ALL:
        f = new_filter(seccomp.ALLOW)
        if retain & NAMESPACE_FLAGS_ALL == 0:
            add(f, eperm, resolve("setns"))
        else:
            add(f, eperm, resolve("setns"), seccomp.Arg(1, seccomp.EQ, 0))
        for name, flag in NAMESPACES:
            if retain & flag:
                continue
            add(f, eperm, resolve("unshare"), seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
            add(f, eperm, resolve("clone"), seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
            if retain & NAMESPACE_FLAGS_ALL:
                add(f, eperm, resolve("setns"), seccomp.Arg(1, seccomp.MASKED_EQ, flag, flag))
        out.append((f, "RestrictNamespaces (unshare/clone/setns of refused namespaces: EPERM; clone3 not filtered, as in systemd 252)"))
    if s.bool("ProtectKernelTunables"):
        f = new_filter(seccomp.ALLOW)
        add(f, eperm, resolve("_sysctl"))
        out.append((f, "ProtectKernelTunables (_sysctl: EPERM)"))
    def group_filter(key, group):
        f = new_filter(seccomp.ALLOW)
        for n in expand(group, groups):
            nr = resolve(n)
            if nr is not None:
                add(f, eperm, nr)
        out.append((f, f"{key} ({group}: EPERM)"))

    if s.bool("ProtectKernelModules"):
        group_filter("ProtectKernelModules", "@module")
    if s.bool("ProtectKernelLogs"):
        f = new_filter(seccomp.ALLOW)
        add(f, eperm, resolve("syslog"))
        out.append((f, "ProtectKernelLogs (syslog: EPERM)"))
    if s.bool("ProtectClock"):
        group_filter("ProtectClock", "@clock")
    if s.bool("PrivateDevices"):
        group_filter("PrivateDevices", "@raw-io")
    archs = s.list("SystemCallArchitectures")
    if archs:
        if any(a != "native" for a in archs):
            raise SetupError(EXIT["seccomp"], f"SystemCallArchitectures={' '.join(archs)}: only 'native' is supported")
        # No rules: syscalls of other ABIs (x86, x32) hit the bad-architecture action, kill.
        f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
        f.set_attr(seccomp.Attr.CTL_NNP, 0)
        out.append((f, "SystemCallArchitectures=native (x86 and x32 syscalls: killed)"))
    if s.bool("LockPersonality"):
        pers = libc.syscall(ctypes.c_long(135), ctypes.c_ulong(0xFFFFFFFF)) & 0xFF
        keep = 0x0008 if pers == 0x0008 else 0  # PER_LINUX32 or PER_LINUX
        f = new_filter(seccomp.ALLOW)
        add(f, eperm, resolve("personality"), seccomp.Arg(0, seccomp.NE, keep))
        out.append((f, f"LockPersonality (personality other than {keep:#x}: EPERM)"))
    return out


def parse_namespaces(v):
    if v is None:
        return None
    try:
        return 0 if parse_bool(v, "RestrictNamespaces") else None
    except SetupError:
        pass
    invert = v.startswith("~")
    flags = 0
    for w in split_words(v[1:] if invert else v):
        match = [f for n, f in NAMESPACES if n == w]
        if not match:
            raise SetupError(2, f"RestrictNamespaces: unknown namespace {w}")
        flags |= match[0]
    return (NAMESPACE_FLAGS_ALL & ~flags) if invert else flags


def hostname_filter():
    f = new_filter(seccomp.ALLOW)
    add(f, seccomp.ERRNO(errno.EPERM), resolve("sethostname"))
    add(f, seccomp.ERRNO(errno.EPERM), resolve("setdomainname"))
    return f


def load_filter(f, what):
    try:
        f.load()
    except (RuntimeError, OSError) as e:
        raise SetupError(EXIT["seccomp"], f"loading the {what} filter: {e}")


# ---------------------------------------------------------------------------------------------
# Credentials, capabilities, user namespace.

def has_cap(cap):
    for line in open("/proc/self/status"):
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> cap & 1)
    return False


CAP_ALL = (1 << 64) - 1


def bounding_set(plan):
    """config_parse_capability_set, then unit_patch_contexts' removals."""
    bset = CAP_ALL
    for val, where in plan.s.seen.get("CapabilityBoundingSet", []):
        invert = val.startswith("~")
        total = 0
        for n in split_words(val[1:] if invert else val):
            if n not in CAPS:
                raise SetupError(2, f"CapabilityBoundingSet: unknown capability {n}")
            total |= 1 << CAPS.index(n)
        if total == 0 or bset == CAP_ALL:
            bset = (~total & CAP_ALL) if invert else total
        else:
            bset = (bset & ~total) if invert else (bset | total)
    s = plan.s
    drop = []
    if s.bool("PrivateDevices"):
        drop += ["CAP_MKNOD", "CAP_SYS_RAWIO"]
    if s.bool("ProtectKernelModules"):
        drop += ["CAP_SYS_MODULE"]
    if s.bool("ProtectKernelLogs"):
        drop += ["CAP_SYSLOG"]
    if s.bool("ProtectClock"):
        drop += ["CAP_SYS_TIME", "CAP_WAKE_ALARM"]
    for n in drop:
        bset &= ~(1 << CAPS.index(n))
    return bset


def setrlimit_closest(which, soft, hard, report):
    """setrlimit_closest(): without CAP_SYS_RESOURCE a limit above our hard limit is lowered to it."""
    inf = resource.RLIM_INFINITY
    try:
        resource.setrlimit(which, (soft, hard))
        return
    except ValueError:
        pass  # the kernel's EPERM: above our hard limit
    except OSError as e:
        if e.errno != errno.EPERM:
            raise SetupError(EXIT["limits"], f"setrlimit {which}: {e}")
    _, highest = resource.getrlimit(which)
    low = lambda a: a if highest == inf or (a != inf and a <= highest) else highest  # noqa: E731
    resource.setrlimit(which, (low(soft), low(hard)))
    name = next(n for n in dir(resource) if n.startswith("RLIMIT_") and getattr(resource, n) == which)
    report.setdefault("limits_lowered", []).append(
        f"{name} {soft}:{hard} lowered to {low(soft)}:{low(hard)} (no CAP_SYS_RESOURCE here)")
    say(f"{name} {soft}:{hard} lowered to the hard limit {highest}, as systemd does without CAP_SYS_RESOURCE")


def drop_bounding_set(bset):
    last = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last + 1):
        if not bset >> cap & 1:
            c_prctl(PR_CAPBSET_DROP, cap)


def setup_private_users(plan):
    """setup_private_users(): root and the unit's user map to themselves, setgroups denied.
    A child still in our user namespace writes the maps once we have unshared."""
    uid = plan.uid if plan.uid is not None else 0
    gid = plan.gid if plan.gid is not None else 0
    uid_map = "0 0 1\n" + (f"{uid} {uid} 1\n" if uid != 0 else "")
    gid_map = "0 0 1\n" + (f"{gid} {gid} 1\n" if gid != 0 else "")
    ready_r, ready_w = os.pipe()
    err_r, err_w = os.pipe()
    ppid = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(ready_w)
        os.close(err_r)
        try:
            os.read(ready_r, 1)
            for f, text in (("setgroups", "deny\n"), ("gid_map", gid_map), ("uid_map", uid_map)):
                with open(f"/proc/{ppid}/{f}", "w") as fh:
                    fh.write(text)
            os._exit(0)
        except BaseException as e:  # noqa: BLE001 - report anything to the parent
            os.write(err_w, str(e).encode())
            os._exit(1)
    os.close(ready_r)
    os.close(err_w)
    c_unshare(CLONE_NEWUSER)
    os.write(ready_w, b"x")
    os.close(ready_w)
    msg = os.read(err_r, 4096)
    os.close(err_r)
    _, st = os.waitpid(pid, 0)
    if msg or st != 0:
        raise SetupError(EXIT["user"], f"writing the user namespace maps: {msg.decode() or st}")


def loopback_up():
    import fcntl
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(s, 0x8913, ifr))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sh22x", b"lo", flags | 0x1 | 0x40))  # SIOCSIFFLAGS UP|RUNNING


def create_exec_dirs(plan):
    for key, path, mode, var, code in plan.exec_dirs:
        try:
            os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
            os.makedirs(path, exist_ok=True)
            os.chmod(path, mode)
            if key != "ConfigurationDirectory":
                uid = plan.uid if plan.uid is not None else 0
                gid = plan.gid if plan.gid is not None else 0
                st = os.stat(path)
                if (st.st_uid, st.st_gid) != (uid, gid):
                    for root, dirs, files in os.walk(path):
                        for n in dirs + files:
                            os.lchown(os.path.join(root, n), uid, gid)
                    os.chown(path, uid, gid)
        except OSError as e:
            raise SetupError(code, f"{key}: {path}: {e}")


# ---------------------------------------------------------------------------------------------

def show(plan, filters):
    print(f"unit {plan.unit.name}: {' '.join(plan.unit.files)}")
    for k, v, w in plan.s.raw:
        print(f"  {k}={v}    ({w})")
    print(f"user {plan.user} uid {plan.uid} gid {plan.gid}; limits {plan.rlimits}")
    if needs_mount_namespace(plan):
        print("mount entries:")
        for e in mount_entries(plan):
            print(f"  {e!r}")
    print("seccomp filters, in load order:")
    for _, d in filters:
        print(f"  {d}")
    print("not applied:")
    for n in plan.not_applied:
        print(f"  {n['setting']}={' '.join(n['values'])}: {n['why']}")


def run(args):
    unit = load(args.unit or os.path.basename(args.unit_file), args.unit_file, args.dropin_dir, args.set)
    s = Settings(unit)
    plan = Plan(unit, s, args.cmd)
    groups = syscall_groups()
    filters = []
    af = address_family_filter(plan)
    if af:
        filters.append(af)
    filters += simple_filters(plan, groups)
    sf, sdesc = syscall_filter(plan, groups)
    if sf:
        filters.append((sf, sdesc))
    if args.show:
        show(plan, filters)
        return 0
    report = {
        "unit": unit.name, "files": unit.files,
        "not_applied": plan.not_applied, "manager_only": sorted(plan.manager_only),
        "seccomp": [d for _, d in filters],
    }
    for n in plan.not_applied:
        say(f"not applied: {n['setting']}={' '.join(n['values'])} ({n['why']})")

    if os.geteuid() != 0:
        raise SetupError(2, "needs root (namespaces, mounts, users), as systemd has")
    # Opened now: the unit's mounts may make its directory read-only.
    report_file = open(args.report, "w") if args.report else None
    # Signals as systemd leaves them: defaults, SIGPIPE ignored (IgnoreSIGPIPE=yes).
    for sig in range(1, signal.NSIG):
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    if s.bool("IgnoreSIGPIPE", True):
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    try:
        os.setsid()
    except OSError:
        pass  # already a process group leader (the caller's choice): keep its group

    if s.get("OOMScoreAdjust") is not None:
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write(s.get("OOMScoreAdjust"))
        except PermissionError as e:
            # As systemd: without the privilege (CAP_SYS_RESOURCE to lower it) it goes on.
            say(f"OOMScoreAdjust={s.get('OOMScoreAdjust')} skipped, as systemd skips it: {e}")
            report["oom_score_adjust"] = f"skipped: {e}"
        except OSError as e:
            raise SetupError(EXIT["oom_adjust"], f"OOMScoreAdjust: {e}")
    if s.get("Nice") is not None:
        os.setpriority(os.PRIO_PROCESS, 0, int(s.get("Nice")))
    # What we create (exec directories, /dev nodes) gets exactly its mode, as in systemd's
    # BLOCK_WITH_UMASK(0000); the unit's UMask= is set just before exec.
    os.umask(0)
    create_exec_dirs(plan)
    env = build_env(plan)
    for name, (soft, hard) in plan.rlimits.items():
        setrlimit_closest(getattr(resource, name), soft, hard, report)
    # get_supplementary_groups(): the user's groups from the group database.
    if plan.user is not None and plan.gid:
        os.initgroups(plan.user, plan.gid)
    if s.bool("PrivateNetwork"):
        c_unshare(CLONE_NEWNET)
        loopback_up()
    if s.bool("PrivateIPC"):
        c_unshare(CLONE_NEWIPC)
    if needs_mount_namespace(plan):
        try:
            setup_mount_namespace(plan)
        except OSError as e:
            raise SetupError(EXIT["namespace"], f"Failed to set up mount namespacing: {e}")
        report["mounts"] = [repr(e) for e in plan.mounts if not e.skipped]
    if s.bool("ProtectHostname"):
        c_unshare(CLONE_NEWUTS)
        load_filter(hostname_filter(), "ProtectHostname")
    if plan.supplementary:
        os.setgroups(sorted(set(os.getgroups()) | set(plan.supplementary)))
    if plan.gid is not None:
        os.setresgid(plan.gid, plan.gid, plan.gid)
    if s.bool("PrivateUsers"):
        setup_private_users(plan)
    exe = plan.cmd[0] if "/" in plan.cmd[0] else shutil.which(plan.cmd[0], path=env["PATH"])
    if exe is None:
        raise SetupError(EXIT["exec"], f"Failed to locate executable {plan.cmd[0]}")
    if s.bool("RestrictRealtime") and s.get("LimitRTPRIO") is None:
        resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))
    bset = bounding_set(plan)
    if bset != CAP_ALL:
        try:
            drop_bounding_set(bset)
        except OSError as e:
            raise SetupError(EXIT["capabilities"], f"Failed to drop capabilities: {e}")
    if plan.uid is not None:
        os.setresuid(plan.uid, plan.uid, plan.uid)
    wd = s.get("WorkingDirectory", "/")
    optional = wd.startswith("-")
    wd = wd.lstrip("-")
    if wd == "~":
        wd = plan.home
    try:
        os.chdir(wd)
    except OSError as e:
        if not optional:
            raise SetupError(EXIT["chdir"], f"Changing to the requested working directory failed: {e}")
        os.chdir("/")
    # context_has_no_new_privileges(): explicit, or implied by any seccomp-based setting when
    # unprivileged at this point.
    implied = not has_cap(21) and (filters or s.bool("PrivateDevices") or s.bool("ProtectHostname")
                                    or s.bool("ProtectKernelTunables"))
    if s.bool("NoNewPrivileges") or implied:
        c_prctl(PR_SET_NO_NEW_PRIVS, 1)
        report["no_new_privileges"] = "explicit" if s.bool("NoNewPrivileges") else "implied"
    os.umask(int(s.get("UMask", "0022"), 8))
    if report_file:
        json.dump(report, report_file, indent=1)
        report_file.close()
    sys.stderr.flush()
    for f, d in filters:
        load_filter(f, d)
    try:
        os.execve(exe, plan.cmd, env)
    except OSError as e:
        # With the filters loaded this may not be able to say more; try.
        os.write(2, f"unit-sandbox: exec {exe}: {e}\n".encode())
        os._exit(EXIT["exec"])


def main():
    ap = argparse.ArgumentParser(
        description="Run CMD with a systemd unit's [Service] sandboxing applied as systemd 252 applies it.")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--unit", help="unit name (NAME or NAME.service; NAME@INSTANCE for templates)")
    g.add_argument("--unit-file", help="a unit file outside the unit directories")
    ap.add_argument("--dropin-dir", action="append", default=[], help="a directory of *.conf drop-ins (above /etc)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one more [Service] assignment, last")
    ap.add_argument("--report", help="write what was applied and what was not (JSON)")
    ap.add_argument("--show", action="store_true", help="print the settings and the plan, run nothing")
    ap.add_argument("cmd", nargs="*", help="the command (after --)")
    args = ap.parse_args()
    if not args.cmd and not args.show:
        ap.error("no command")
    args.dropin_dir = [os.path.abspath(d) for d in args.dropin_dir]
    try:
        return run(args)
    except SetupError as e:
        say(str(e))
        return e.code
    except OSError as e:
        say(str(e))
        return EXIT["namespace"]


if __name__ == "__main__":
    sys.exit(main())
