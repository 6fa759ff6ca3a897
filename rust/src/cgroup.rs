//! What this process's memory cgroup still allows it to allocate.
//!
//! A container's memory limit is not in the machine's `MemAvailable`, so a host pool sized from
//! that alone can be killed by the kernel's OOM killer long after it was built. The budget check
//! takes the smaller of the machine's figure and the tightest cgroup level's `limit - usage`
//! (cgroup v2's `memory.max` and `memory.high` first, then v1's memory controller), with
//! inactive file pages counted as free, as the kernel reclaims them before it refuses memory
//! (the kubelet's working set).

use std::fs;
use std::path::{Component, Path, PathBuf};

/// Bytes a cgroup level still allows, and words naming the limit (for a refusal's message).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupLimit {
    pub available: u64,
    pub source: String,
}

struct Files {
    /// The files whose value bounds the level's usage; the smallest binds.
    limits: &'static [&'static str],
    usage: &'static str,
    inactive: &'static str,
    version: &'static str,
}

// v2's `memory.high` throttles and reclaims hard above it, so (as SGLang 0.5.22+ reads it) a pool
// is sized below it as below `memory.max`.
const V2: Files = Files {
    limits: &["memory.max", "memory.high"],
    usage: "memory.current",
    inactive: "inactive_file",
    version: "v2",
};

const V1: Files = Files {
    limits: &["memory.limit_in_bytes"],
    usage: "memory.usage_in_bytes",
    inactive: "total_inactive_file",
    version: "v1",
};

/// The tightest limit of this process's memory cgroup, or None where no level sets one.
/// `root` is where the hierarchies are mounted (`/sys/fs/cgroup`) and `self_cgroup` the process's
/// cgroup file (`/proc/self/cgroup`); both are parameters so tests can point at fake trees.
pub fn memory_limit(root: &Path, self_cgroup: &Path) -> Option<CgroupLimit> {
    let (v2, v1) = own_cgroups(self_cgroup);
    let found = v2.and_then(|path| tightest(&levels(root, &path), &V2));
    found.or_else(|| v1.and_then(|path| tightest(&levels(&root.join("memory"), &path), &V1)))
}

/// Decimal GB with two decimals, as SGLang's messages print sizes (`x / 1e9:.2f`).
pub fn gb(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / 1e9)
}

/// (cgroup v2 path, v1 memory-controller path) from the process's cgroup file.
fn own_cgroups(self_cgroup: &Path) -> (Option<String>, Option<String>) {
    let Ok(text) = fs::read_to_string(self_cgroup) else {
        return (None, None);
    };
    let (mut v2, mut v1) = (None, None);
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(hierarchy), Some(controllers), Some(path)) =
            (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if hierarchy == "0" && controllers.is_empty() {
            v2 = Some(path.to_owned());
        } else if controllers.split(',').any(|c| c == "memory") {
            v1 = Some(path.to_owned());
        }
    }
    (v2, v1)
}

/// The directories whose limits bind the cgroup `path`, leaf first, up to and including the
/// mount. A path that is not visible under the mount (a cgroup namespace or a private mount
/// shows the process's own cgroup as the mount itself) stands for the mount.
fn levels(mount: &Path, path: &str) -> Vec<PathBuf> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let escapes = Path::new(path)
        .components()
        .any(|c| c == Component::ParentDir);
    let leaf = parts.iter().fold(mount.to_path_buf(), |dir, p| dir.join(p));
    if escapes || !leaf.is_dir() {
        return vec![mount.to_path_buf()];
    }
    let mut found: Vec<PathBuf> = (1..=parts.len())
        .rev()
        .map(|n| {
            parts[..n]
                .iter()
                .fold(mount.to_path_buf(), |dir, p| dir.join(p))
        })
        .collect();
    found.push(mount.to_path_buf());
    found
}

/// A file holding one number; None when absent, unreadable or not a number ("max": no limit).
fn read_value(path: &Path) -> Option<u64> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// One field of a `memory.stat` file (0 when absent).
fn read_stat(path: &Path, key: &str) -> u64 {
    let Ok(text) = fs::read_to_string(path) else {
        return 0;
    };
    text.lines()
        .find_map(|line| {
            let (name, value) = line.split_once(' ')?;
            (name == key).then(|| value.trim().parse().ok()).flatten()
        })
        .unwrap_or(0)
}

/// The smallest `limit - (usage - inactive file pages)` over the levels that set a limit.
fn tightest(levels: &[PathBuf], files: &Files) -> Option<CgroupLimit> {
    let mut best: Option<CgroupLimit> = None;
    for level in levels {
        let limit = files
            .limits
            .iter()
            .filter_map(|name| Some((read_value(&level.join(name))?, *name)))
            .min();
        let (Some((limit, limit_name)), Some(usage)) =
            (limit, read_value(&level.join(files.usage)))
        else {
            continue;
        };
        let reclaimable = read_stat(&level.join("memory.stat"), files.inactive);
        let free = limit.saturating_sub(usage.saturating_sub(reclaimable));
        if best.as_ref().is_some_and(|b| b.available <= free) {
            continue;
        }
        let mut usage_text = format!("{} {} GB", files.usage, gb(usage));
        if reclaimable > 0 {
            usage_text = format!(
                "({usage_text} less {} GB inactive file cache)",
                gb(reclaimable)
            );
        }
        let source = format!(
            "cgroup {} limit {}: {} {} GB - {usage_text}",
            files.version,
            level.display(),
            limit_name,
            gb(limit),
        );
        best = Some(CgroupLimit {
            available: free,
            source,
        });
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    struct Tree {
        dir: PathBuf,
    }

    impl Tree {
        fn new(name: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("hostkv-cgroup-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(dir.join("cgroup")).unwrap();
            Self { dir }
        }
        fn root(&self) -> PathBuf {
            self.dir.join("cgroup")
        }
        fn write(&self, rel: &str, text: &str) {
            let path = self.dir.join(rel);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        }
        fn limit(&self) -> Option<CgroupLimit> {
            memory_limit(&self.root(), &self.dir.join("proc_cgroup"))
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn v2_tightest_level_wins_and_is_named() {
        let t = Tree::new("v2");
        t.write("proc_cgroup", "0::/pods/p1\n");
        t.write("cgroup/memory.max", "max\n");
        t.write("cgroup/memory.current", "1\n");
        t.write("cgroup/pods/memory.max", &format!("{}\n", 12 * GIB));
        t.write("cgroup/pods/memory.current", &format!("{}\n", 10 * GIB));
        t.write("cgroup/pods/p1/memory.max", &format!("{}\n", 30 * GIB));
        t.write("cgroup/pods/p1/memory.current", &format!("{}\n", GIB));
        let limit = t.limit().unwrap();
        assert_eq!(limit.available, 2 * GIB);
        let pods = t.root().join("pods");
        assert!(
            limit.source.contains(&format!("{}:", pods.display())),
            "{}",
            limit.source
        );
        assert!(limit.source.starts_with("cgroup v2 limit"));
    }

    #[test]
    fn inactive_file_pages_count_as_free() {
        let t = Tree::new("stat");
        t.write("proc_cgroup", "0::/p\n");
        t.write("cgroup/p/memory.max", &format!("{}\n", 30 * GIB));
        t.write("cgroup/p/memory.current", &format!("{}\n", 20 * GIB));
        t.write(
            "cgroup/p/memory.stat",
            &format!("anon 1\ninactive_file {}\n", 6 * GIB),
        );
        let limit = t.limit().unwrap();
        assert_eq!(limit.available, 16 * GIB);
        assert!(limit.source.contains("inactive file cache"));
    }

    #[test]
    fn a_path_outside_the_mount_reads_the_mount() {
        let t = Tree::new("ns");
        t.write("cgroup/memory.max", &format!("{}\n", 4 * GIB));
        t.write("cgroup/memory.current", &format!("{}\n", GIB));
        for own in [
            "0::/\n",
            "0::/system.slice/x.scope\n",
            "0::/../../elsewhere\n",
        ] {
            t.write("proc_cgroup", own);
            assert_eq!(t.limit().unwrap().available, 3 * GIB, "{own}");
        }
    }

    #[test]
    fn v1_memory_controller_and_no_limit() {
        let t = Tree::new("v1");
        t.write(
            "proc_cgroup",
            "12:pids:/d/a\n4:memory:/d/a\n1:name=systemd:/d/a\n0::/\n",
        );
        t.write(
            "cgroup/memory/d/a/memory.limit_in_bytes",
            &format!("{}\n", 16 * GIB),
        );
        t.write(
            "cgroup/memory/d/a/memory.usage_in_bytes",
            &format!("{}\n", 12 * GIB),
        );
        t.write(
            "cgroup/memory/d/a/memory.stat",
            &format!("total_inactive_file {}\n", 4 * GIB),
        );
        let limit = t.limit().unwrap();
        assert_eq!(limit.available, 8 * GIB);
        assert!(limit.source.starts_with("cgroup v1 limit"));
        t.write("cgroup/memory/d/a/memory.limit_in_bytes", "max\n");
        assert_eq!(t.limit(), None);
        fs::remove_file(t.dir.join("proc_cgroup")).unwrap();
        assert_eq!(t.limit(), None);
    }

    #[test]
    fn v2_memory_high_binds_below_memory_max() {
        let t = Tree::new("high");
        t.write("proc_cgroup", "0::/p\n");
        t.write("cgroup/p/memory.max", &format!("{}\n", 30 * GIB));
        t.write("cgroup/p/memory.high", &format!("{}\n", 12 * GIB));
        t.write("cgroup/p/memory.current", &format!("{}\n", 10 * GIB));
        let limit = t.limit().unwrap();
        assert_eq!(limit.available, 2 * GIB);
        assert!(
            limit.source.contains("memory.high 12.88 GB"),
            "{}",
            limit.source
        );
        t.write("cgroup/p/memory.high", "max\n");
        assert_eq!(t.limit().unwrap().available, 20 * GIB);
        t.write("cgroup/p/memory.max", "max\n");
        assert_eq!(t.limit(), None);
    }

    #[test]
    fn usage_past_the_limit_leaves_nothing() {
        let t = Tree::new("over");
        t.write("proc_cgroup", "0::/\n");
        t.write("cgroup/memory.max", "100\n");
        t.write("cgroup/memory.current", "250\n");
        assert_eq!(t.limit().unwrap().available, 0);
    }
}
