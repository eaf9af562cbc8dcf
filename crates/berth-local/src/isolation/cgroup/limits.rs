//! What an instance may use: the memory, pids and CPU limits written to
//! its cgroup on either hierarchy, and the OOM kills counted there.

use std::fs;

use super::{CgroupError, InstanceCgroup, Parents, mkdir, write_file};
use crate::isolation::Limits;

/// The CFS period berth uses for CPU limits, in microseconds.
const CPU_PERIOD_US: u64 = 100_000;

/// The files and values that give a v1 cgroup `limits`, per controller
/// directory (`memory`, `pids`, `cpu`), in the order they must be written.
/// `optional` files may be absent (swap accounting is a boot option).
///
/// `cpu.cfs_period_us` is left at the kernel's default, which is
/// [`CPU_PERIOD_US`]: each write of a CFS bandwidth file makes the kernel
/// check every CPU cgroup on the host, so a second write would add a cost
/// that grows with the number of instances to every launch. For the same
/// reason no CPU limit is not written to a cgroup `made_now`: it is the
/// kernel's default there.
pub fn v1_limit_files(
    limits: &Limits,
    made_now: bool,
) -> Vec<(&'static str, &'static str, String, bool)> {
    let bytes = limits.memory_max_mb.saturating_mul(1024 * 1024).to_string();
    let mut files = vec![
        ("memory", "memory.limit_in_bytes", bytes.clone(), false),
        // Must not be below the memory limit, so it comes second.
        ("memory", "memory.memsw.limit_in_bytes", bytes, true),
        ("pids", "pids.max", limits.pids_max.to_string(), false),
    ];
    if writes_cpu(limits, made_now) {
        files.push((
            "cpu",
            "cpu.cfs_quota_us",
            v1_quota(limits.cpu_max_percent),
            false,
        ));
    }
    files
}

/// Whether a cgroup needs its CPU limit written: it has one, or the
/// cgroup existed before (a leftover may hold another).
fn writes_cpu(limits: &Limits, made_now: bool) -> bool {
    limits.cpu_max_percent != 0 || !made_now
}

fn v1_quota(percent: u32) -> String {
    if percent == 0 {
        "-1".to_owned()
    } else {
        (u64::from(percent) * CPU_PERIOD_US / 100).to_string()
    }
}

/// The files and values that give a v2 cgroup `limits`, in order; no
/// CPU limit is written as in [`v1_limit_files`].
pub fn v2_limit_files(limits: &Limits, made_now: bool) -> Vec<(&'static str, String, bool)> {
    let quota = if limits.cpu_max_percent == 0 {
        "max".to_owned()
    } else {
        (u64::from(limits.cpu_max_percent) * CPU_PERIOD_US / 100).to_string()
    };
    let mut files = vec![
        (
            "memory.max",
            limits.memory_max_mb.saturating_mul(1024 * 1024).to_string(),
            false,
        ),
        // No swapping past the limit; absent without swap accounting.
        ("memory.swap.max", "0".to_owned(), true),
        // An OOM kill takes the whole instance, not one of its processes.
        ("memory.oom.group", "1".to_owned(), true),
        ("pids.max", limits.pids_max.to_string(), false),
    ];
    if writes_cpu(limits, made_now) {
        files.push(("cpu.max", format!("{quota} {CPU_PERIOD_US}"), false));
    }
    files
}

/// The `oom_kill` counter of a v1 `memory.oom_control` or a v2
/// `memory.events` file.
pub fn oom_kills(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
}

impl InstanceCgroup {
    /// Creates the directories and writes the limits.
    pub fn create(&self, limits: &Limits) -> Result<(), CgroupError> {
        let created = self.create_unchecked(limits);
        if created.is_err() {
            self.remove();
        }
        created
    }

    fn create_unchecked(&self, limits: &Limits) -> Result<(), CgroupError> {
        let mut made_now = true;
        for dir in self.dirs() {
            made_now &= mkdir(&dir)?;
        }
        match &self.parents {
            Parents::V1 {
                memory, pids, cpu, ..
            } => {
                for (controller, file, value, optional) in v1_limit_files(limits, made_now) {
                    let parent = match controller {
                        "memory" => memory,
                        "pids" => pids,
                        _ => cpu,
                    };
                    let path = parent.join(&self.leaf).join(file);
                    if optional && !path.exists() {
                        continue;
                    }
                    write_file(&path, &value, file)?;
                }
            }
            Parents::V2 { parent } => {
                for (file, value, optional) in v2_limit_files(limits, made_now) {
                    let path = parent.join(&self.leaf).join(file);
                    if optional && !path.exists() {
                        continue;
                    }
                    write_file(&path, &value, file)?;
                }
            }
        }
        Ok(())
    }

    /// The OOM kills counted in the cgroup so far (`None`: unreadable).
    pub fn oom_kills(&self) -> Option<u64> {
        let path = match &self.parents {
            Parents::V1 { memory, .. } => memory.join(&self.leaf).join("memory.oom_control"),
            Parents::V2 { parent } => parent.join(&self.leaf).join("memory.events"),
        };
        oom_kills(&fs::read_to_string(path).ok()?)
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::isolation::cgroup::{Layout, prepare_parents};

    #[test]
    fn limit_values_for_both_hierarchies() {
        let limits = Limits {
            memory_max_mb: 64,
            pids_max: 32,
            cpu_max_percent: 150,
            ..Limits::default()
        };
        let v1 = v1_limit_files(&limits, true);
        assert_eq!(
            v1[0],
            (
                "memory",
                "memory.limit_in_bytes",
                "67108864".to_owned(),
                false
            )
        );
        assert_eq!(v1[1].1, "memory.memsw.limit_in_bytes");
        assert!(v1[1].3, "memsw is optional");
        assert_eq!(v1[2], ("pids", "pids.max", "32".to_owned(), false));
        assert_eq!(
            v1[3],
            ("cpu", "cpu.cfs_quota_us", "150000".to_owned(), false)
        );
        assert_eq!(v1.len(), 4, "the period stays the kernel's default");
        let v2 = v2_limit_files(&limits, true);
        assert_eq!(v2[0], ("memory.max", "67108864".to_owned(), false));
        assert_eq!(v2[3], ("pids.max", "32".to_owned(), false));
        assert_eq!(v2[4], ("cpu.max", "150000 100000".to_owned(), false));
        let unlimited_cpu = Limits {
            cpu_max_percent: 0,
            ..limits
        };
        // No CPU limit is the default of a cgroup made now, and each CFS
        // write costs a walk over every CPU cgroup of the host.
        assert_eq!(v1_limit_files(&unlimited_cpu, true).len(), 3);
        assert!(
            v2_limit_files(&unlimited_cpu, true)
                .iter()
                .all(|(file, _, _)| *file != "cpu.max")
        );
        // A cgroup that was there already may hold another limit.
        assert_eq!(v1_limit_files(&unlimited_cpu, false)[3].2, "-1");
        assert_eq!(v2_limit_files(&unlimited_cpu, false)[4].1, "max 100000");
    }

    #[test]
    fn oom_counters_parse() {
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n";
        assert_eq!(oom_kills(v1), Some(2));
        let v2 = "low 0\nhigh 0\nmax 17\noom 1\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(oom_kills(v2), Some(1));
        assert_eq!(oom_kills("under_oom 0\n"), None);
    }

    /// A fake cgroup v2 tree: what the kernel would put in each directory
    /// is created by hand, then the writers run against it.
    #[test]
    fn the_v2_writer_against_a_fake_tree() {
        let tmp = tempfile::tempdir().unwrap();
        let mount = tmp.path().join("cgroup");
        let own_dir = mount.join("system.slice/berth.service");
        fs::create_dir_all(&own_dir).unwrap();
        for file in ["cgroup.subtree_control", "cgroup.procs"] {
            fs::write(own_dir.join(file), "").unwrap();
        }
        let layout = Layout::V2 {
            mount: mount.clone(),
            own: "/system.slice/berth.service".into(),
            favordynmods: false,
        };
        let parents = layout.parents("id1");
        let Parents::V2 { parent } = &parents else {
            panic!("{parents:?}")
        };
        // The kernel creates these in every new directory.
        let kernel_files = |dir: &Path| {
            fs::create_dir_all(dir).unwrap();
            for file in [
                "cgroup.subtree_control",
                "cgroup.procs",
                "memory.max",
                "memory.oom.group",
                "pids.max",
                "cpu.max",
                "memory.events",
            ] {
                fs::write(dir.join(file), "").unwrap();
            }
        };
        kernel_files(&own_dir.join("berth-supervisor"));
        kernel_files(parent);
        prepare_parents(&layout, &parents, 4242).unwrap();
        let read = |p: PathBuf| fs::read_to_string(p).unwrap();
        assert_eq!(read(own_dir.join("berth-supervisor/cgroup.procs")), "4242");
        assert_eq!(
            read(own_dir.join("cgroup.subtree_control")),
            "+memory +pids +cpu"
        );
        assert_eq!(
            read(parent.join("cgroup.subtree_control")),
            "+memory +pids +cpu"
        );

        let cgroup = InstanceCgroup::new(parents.clone(), "alice.main.77".into());
        let leaf = parent.join("alice.main.77");
        kernel_files(&leaf);
        let limits = Limits {
            memory_max_mb: 16,
            pids_max: 8,
            cpu_max_percent: 50,
            ..Limits::default()
        };
        cgroup.create(&limits).unwrap();
        assert_eq!(read(leaf.join("memory.max")), "16777216");
        assert_eq!(read(leaf.join("memory.oom.group")), "1");
        assert_eq!(read(leaf.join("pids.max")), "8");
        assert_eq!(read(leaf.join("cpu.max")), "50000 100000");
        assert!(!leaf.join("memory.swap.max").exists(), "optional, skipped");
        assert_eq!(cgroup.join_files(), vec![leaf.join("cgroup.procs")]);
        fs::write(leaf.join("memory.events"), "oom 1\noom_kill 1\n").unwrap();
        assert_eq!(cgroup.oom_kills(), Some(1));

        // A real cgroup directory is removable once empty; the fake one has
        // files, so removal reports it instead of deleting anything.
        let failed = cgroup.remove();
        assert_eq!(failed.len(), 1);
        assert!(leaf.join("memory.max").exists());
    }
}
