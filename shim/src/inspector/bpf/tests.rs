//! Pure tests of the eBPF side (the root-only tests that load the programs are in
//! `tests/root_bpf.rs`).

use super::probes::{kernel_dev, parse_cpu_list};
use super::programs::RawCounters;
use super::*;

#[test]
fn host_probes_can_be_shared_between_threads() {
    fn check<T: Send + Sync>() {}
    check::<HostProbes>();
}

#[test]
fn parses_cpu_lists() {
    assert_eq!(parse_cpu_list("0-1\n"), vec![0, 1]);
    assert_eq!(parse_cpu_list("0,2-4,7"), vec![0, 2, 3, 4, 7]);
    assert_eq!(parse_cpu_list(""), Vec::<usize>::new());
}

#[test]
fn fs_classes_match_the_c_enum() {
    let header = include_str!("../../../../bpf-programs/include/inspector.h");
    let start = header.find("enum fs_class {").unwrap();
    let body = &header[start..start + header[start..].find('}').unwrap()];
    let names: Vec<&str> = body
        .lines()
        .skip(1)
        .map(|l| l.trim().trim_end_matches(','))
        .filter(|l| l.starts_with("FS_"))
        .collect();
    assert_eq!(names.len(), FS_CLASSES + 1, "{names:?}"); // + FS_CLASSES itself
    for (class, c_name) in FsClass::ALL.iter().zip(&names) {
        let rust = format!("FS_{}", class.name().replace('-', "_").to_uppercase());
        let expect = match *class {
            FsClass::MmapShared => "FS_MMAP_SHARED".to_string(),
            _ => rust,
        };
        assert_eq!(&expect, c_name);
    }
    assert_eq!(
        std::mem::size_of::<RawCounters>(),
        8 * (FS_CLASSES + STATE_CLASSES + 10)
    );
}

#[test]
fn state_classes_match_the_c_enum() {
    let header = include_str!("../../../../bpf-programs/include/inspector.h");
    let start = header.find("enum state_class {").unwrap();
    let body = &header[start..start + header[start..].find('}').unwrap()];
    let names: Vec<&str> = body
        .lines()
        .skip(1)
        .map(|l| l.trim().split([',', ' ', '\t']).next().unwrap_or(""))
        .filter(|l| l.starts_with("ST_"))
        .collect();
    assert_eq!(names.len(), STATE_CLASSES, "{names:?}");
    for (class, c_name) in StateClass::ALL.iter().zip(&names) {
        let rust = format!("ST_{}", class.name().replace('-', "_").to_uppercase());
        assert_eq!(&rust, c_name);
    }
    assert!(header.contains("\tSTATE_CLASSES\n"));
}

#[test]
fn map_values_match_the_c_layouts() {
    use super::programs::{RawQuota, RawRun, RUN_RSEQ_MAX};
    // struct run: switches_out, cgroup_id, flags, charged, signals, interactions,
    // rseq[RUN_RSEQ_MAX].
    assert_eq!(std::mem::size_of::<RawRun>(), 8 * (6 + RUN_RSEQ_MAX));
    assert_eq!(std::mem::size_of::<RawQuota>(), 16);
    let header = include_str!("../../../../bpf-programs/include/inspector.h");
    assert!(header.contains("#define RUN_RSEQ_MAX 8"));
    assert!(header.contains("__u64 charged;"));
    let run = &header[header.find("struct run {").unwrap()..];
    let order: Vec<usize> = [
        "switches_out;",
        "signals;",
        "interactions;",
        "rseq[RUN_RSEQ_MAX];",
    ]
    .iter()
    .map(|f| run.find(f).unwrap())
    .collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");
}

#[test]
fn over_quota_counts_only_since_the_mark() {
    let earlier = CgroupCounters {
        over_quota: 5,
        errors: 1,
        ..Default::default()
    };
    let now = CgroupCounters {
        over_quota: 12,
        errors: 1,
        ..Default::default()
    };
    let since = now.since(&earlier);
    assert_eq!((since.over_quota, since.errors), (7, 0));
    assert_eq!(earlier.since(&now).over_quota, 0);
}

/// `st_dev` as stat(2) gives it, in the kernel's `s_dev` encoding the programs compare with:
/// overlays get anonymous devices (major 0) whose minors pass 255 on a busy host.
#[test]
fn rootfs_devices_in_the_kernel_encoding() {
    assert_eq!(kernel_dev(libc::makedev(0, 42)), 42);
    assert_eq!(kernel_dev(libc::makedev(0, 300)), 300);
    assert_eq!(kernel_dev(libc::makedev(0, 0x12345)), 0x12345);
    assert_eq!(kernel_dev(libc::makedev(8, 1)), (8 << 20) | 1);
    assert_eq!(kernel_dev(libc::makedev(259, 70_000)), (259 << 20) | 70_000);
}
