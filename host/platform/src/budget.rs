//! How much host memory this process may still take: the kernel's estimate of memory
//! available for new allocations (`MemAvailable`), lowered by the process's cgroup limit
//! (v2 `memory.max`, v1 `memory.limit_in_bytes`) where one is set.
//!
//! Host pools are allocated lazily by the kernel: a pool larger than the machine allocates
//! fine and the process is killed by the OOM killer (or gets SIGBUS from a full `/dev/shm`)
//! when the pool is first touched, long after start. kvferry-transfer's pool allocator
//! checks every host pool against this budget first, so a layout that cannot fit is refused
//! at start with the numbers.

use std::fmt;
use std::fs;

/// The host memory a process may still allocate, and what limits it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostBudget {
    /// Bytes.
    pub bytes: u64,
    /// What set the figure: `MemAvailable`, `cgroup memory.max`, ...
    pub limit: String,
}

impl fmt::Display for HostBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} available ({})",
            crate::units::bytes(self.bytes),
            self.limit
        )
    }
}

impl HostBudget {
    /// This process's budget now; `None` where `/proc/meminfo` cannot be read (not Linux).
    pub fn measure() -> Option<HostBudget> {
        let meminfo = fs::read_to_string("/proc/meminfo").ok()?;
        let available = mem_available(&meminfo)?;
        let mut budget = HostBudget {
            bytes: available,
            limit: "MemAvailable".into(),
        };
        let cgroup = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        if let Some((limit, source)) =
            cgroup_headroom(&cgroup, |path| fs::read_to_string(path).ok())
        {
            if limit < budget.bytes {
                budget = HostBudget {
                    bytes: limit,
                    limit: source,
                };
            }
        }
        Some(budget)
    }
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let rest = line.strip_prefix("MemAvailable:")?;
        let kib: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        kib.checked_mul(1024)
    })
}

/// What the process's memory cgroup still allows (limit minus usage) and which file said
/// so; `None` without a limit. `read` reads a file of `/sys/fs/cgroup`.
fn cgroup_headroom(cgroup: &str, read: impl Fn(&str) -> Option<String>) -> Option<(u64, String)> {
    let number = |text: Option<String>| -> Option<u64> { text?.trim().parse().ok() };
    for line in cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        let path = path.trim_end_matches('/');
        let (limit_file, usage_file) = if controllers.is_empty() {
            (
                format!("/sys/fs/cgroup{path}/memory.max"),
                format!("/sys/fs/cgroup{path}/memory.current"),
            )
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"),
                format!("/sys/fs/cgroup/memory{path}/memory.usage_in_bytes"),
            )
        } else {
            continue;
        };
        // "max" (v2) or a huge page-rounded number (v1) mean no limit.
        let Some(limit) = number(read(&limit_file)).filter(|&l| l < 1 << 60) else {
            continue;
        };
        let usage = number(read(&usage_file)).unwrap_or(0);
        return Some((limit.saturating_sub(usage), format!("cgroup {limit_file}")));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_mem_available() {
        let meminfo =
            "MemTotal:       24590000 kB\nMemFree:  1000 kB\nMemAvailable:   23916432 kB\n";
        assert_eq!(mem_available(meminfo), Some(23_916_432 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn cgroup_v2_limit_minus_usage() {
        let files = |path: &str| match path {
            "/sys/fs/cgroup/job/memory.max" => Some("8589934592\n".to_string()),
            "/sys/fs/cgroup/job/memory.current" => Some("1073741824\n".to_string()),
            _ => None,
        };
        assert_eq!(
            cgroup_headroom("0::/job\n", files),
            Some((7 << 30, "cgroup /sys/fs/cgroup/job/memory.max".to_string()))
        );
        // "max": no limit.
        let unlimited = |path: &str| path.ends_with("memory.max").then(|| "max\n".to_string());
        assert_eq!(cgroup_headroom("0::/job\n", unlimited), None);
    }

    #[test]
    fn cgroup_v1_memory_controller() {
        let files = |path: &str| match path {
            "/sys/fs/cgroup/memory/a/b/memory.limit_in_bytes" => Some("4294967296".to_string()),
            "/sys/fs/cgroup/memory/a/b/memory.usage_in_bytes" => Some("294967296".to_string()),
            _ => None,
        };
        let cgroup = "5:devices:/\n4:memory:/a/b\n0::/\n";
        assert_eq!(
            cgroup_headroom(cgroup, files).map(|(n, _)| n),
            Some(4_000_000_000)
        );
        // v1's "unlimited" is a page-rounded 2^63.
        let huge = |path: &str| {
            path.ends_with("limit_in_bytes")
                .then(|| "9223372036854771712".to_string())
        };
        assert_eq!(cgroup_headroom("4:memory:/\n", huge), None);
    }

    #[test]
    fn this_process_has_a_budget() {
        let budget = HostBudget::measure().expect("Linux has /proc/meminfo");
        assert!(budget.bytes > 0, "{budget}");
    }
}
