//! Processes as `/proc` shows them: liveness, scheduler state, memory, and
//! the instances berth started (found by their environment), plus killing
//! what a test left behind.

use std::path::{Path, PathBuf};

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use serde_json::Value;

/// Sends `sig` to `pid`, ignoring a process that is already gone.
pub fn signal(pid: u32, sig: Signal) {
    let Ok(raw) = i32::try_from(pid) else {
        return;
    };
    let _ = nix::sys::signal::kill(Pid::from_raw(raw), sig);
}

/// True while a process with this pid exists and is not a zombie.
pub fn alive(pid: u64) -> bool {
    proc_state_of(pid).is_some_and(|state| state != 'Z' && state != 'X')
}

/// The scheduler state letter of a process (`R`, `S`, `T` stopped, `Z`
/// zombie, …), if it exists.
pub fn proc_state(pid: u32) -> Option<char> {
    proc_state_of(u64::from(pid))
}

fn proc_state_of(pid: u64) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: the fields start
    // after the last `)`.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Whether a process is frozen: stopped by a signal (`T`), or in a cgroup
/// whose freezer says it is frozen (a cgroup-frozen task shows `D` or `S`,
/// never `T`, so its state letter alone cannot tell).
pub fn frozen(pid: u32) -> bool {
    if proc_state(pid) == Some('T') {
        return true;
    }
    let Ok(cgroups) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
        return false;
    };
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    cgroups.lines().any(|line| {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            return false;
        };
        let path = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "freezer") {
            cgroup_mount(&mounts, |fs, opts| {
                fs == "cgroup" && opts.split(',').any(|o| o == "freezer")
            })
            .and_then(|m| std::fs::read_to_string(m.join(path).join("freezer.state")).ok())
            .is_some_and(|s| s.trim() == "FROZEN")
        } else if controllers.is_empty() {
            cgroup_mount(&mounts, |fs, _| fs == "cgroup2")
                .and_then(|m| std::fs::read_to_string(m.join(path).join("cgroup.events")).ok())
                .is_some_and(|s| s.lines().any(|l| l.trim() == "frozen 1"))
        } else {
            false
        }
    })
}

/// The mount point of the first cgroup file system in `mountinfo` whose
/// type and super options `wanted` accepts.
fn cgroup_mount(
    mountinfo: &str,
    wanted: impl Fn(&str, &str) -> bool,
) -> Option<std::path::PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (mount, fs) = line.split_once(" - ")?;
        let point = mount.split_whitespace().nth(4)?;
        let mut fs = fs.split_whitespace();
        let (kind, _source, options) = (fs.next()?, fs.next()?, fs.next().unwrap_or(""));
        wanted(kind, options).then(|| std::path::PathBuf::from(point))
    })
}

/// Resident memory of a process in KiB (`VmRSS` in /proc/<pid>/status).
pub fn rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// Live processes (not zombies) any of whose uids (real, effective, saved,
/// filesystem) lies in `uids`, as `(pid, uid)`: what is left of the
/// instance accounts of that range, whatever session, group or parent
/// those processes have.
pub fn processes_of_uids(uids: std::ops::Range<u32>) -> Vec<(u32, u32)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
            let uid = status
                .lines()
                .find_map(|l| l.strip_prefix("Uid:"))?
                .split_whitespace()
                .filter_map(|u| u.parse::<u32>().ok())
                .find(|u| uids.contains(u))?;
            alive(u64::from(pid)).then_some((pid, uid))
        })
        .collect()
}

/// A live process berth started for an instance, as its environment
/// names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceProcess {
    /// Its pid.
    pub pid: u32,
    /// `BERTH_USER`.
    pub user: String,
    /// `BERTH_ROLE`: `main` or `watchdog`.
    pub role: String,
    /// `HOME`, which lies under the data dir of the berth that started it.
    pub home: PathBuf,
}

/// The instance `pid` belongs to, if it is alive and its environment has
/// `BERTH_USER`, `BERTH_ROLE` and `HOME`, whoever its parent is.
pub fn instance_of(pid: u32) -> Option<InstanceProcess> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let var = |name: &[u8]| {
        environ
            .split(|b| *b == 0)
            .find_map(|v| v.strip_prefix(name))
            .map(|v| String::from_utf8_lossy(v).into_owned())
    };
    let process = InstanceProcess {
        pid,
        user: var(b"BERTH_USER=")?,
        role: var(b"BERTH_ROLE=")?,
        home: PathBuf::from(var(b"HOME=")?),
    };
    alive(u64::from(pid)).then_some(process)
}

/// Every live instance process on the host, in one pass over `/proc`.
pub fn instance_processes() -> Vec<InstanceProcess> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(instance_of)
        .collect()
}

/// Pids of the live `role` processes of `user` whose `HOME` is under
/// `data_dir`: the instances one berth started for that user.
pub fn instance_pids(data_dir: &Path, user: &str, role: &str) -> Vec<u32> {
    let data_dir = data_dir
        .canonicalize()
        .unwrap_or_else(|_| data_dir.to_owned());
    instance_processes()
        .into_iter()
        .filter(|p| p.user == user && p.role == role && p.home.starts_with(&data_dir))
        .map(|p| p.pid)
        .collect()
}

/// Kills the shim and the program group of every state file under
/// `<data_dir>/run`: what a test's berth left running.
pub fn kill_instances_under(data_dir: &Path) {
    let Ok(slugs) = std::fs::read_dir(data_dir.join("run")) else {
        return;
    };
    for slug in slugs.flatten() {
        let Ok(files) = std::fs::read_dir(slug.path()) else {
            continue;
        };
        for file in files.flatten() {
            let path = file.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let Ok(state) = std::fs::read_to_string(&path) else {
                continue;
            };
            let Ok(state) = serde_json::from_str::<Value>(&state) else {
                continue;
            };
            if let Some(pid) = state["pid"].as_i64().and_then(|p| i32::try_from(p).ok()) {
                let _ = nix::sys::signal::killpg(Pid::from_raw(pid), Signal::SIGKILL);
            }
            if let Some(pid) = state["shim_pid"]
                .as_u64()
                .and_then(|p| u32::try_from(p).ok())
            {
                signal(pid, Signal::SIGKILL);
            }
        }
    }
}

/// The shim zygote (`berth shim`, with nothing after it) that the `berth
/// serve` with pid `berth` started, if it runs.
pub fn zygote_of(berth: u32) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.find_map(|entry| {
        let pid: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let ppid: u32 = stat
            .rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let args: Vec<&[u8]> = cmdline
            .split(|&b| b == 0)
            .filter(|a| !a.is_empty())
            .collect();
        let is_zygote = args.len() == 2 && args[1] == b"shim";
        (ppid == berth && is_zygote && alive(u64::from(pid))).then_some(pid)
    })
}

/// A loopback TCP port nobody listens on right now (another process may
/// take it before the caller binds it).
///
/// # Panics
///
/// When no port can be bound at all.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free loopback port")
}
