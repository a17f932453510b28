//! What the root-only test targets (`tests/root_*.rs`) share: the one policy for what they need.
//!
//! Those tests mount overlays and tmpfs, create cgroups and device nodes, load eBPF programs,
//! run containers with runc and CRIU, or fork children. They need root and the tools and
//! filesystems they name. A test that cannot run **fails**, saying what is missing; none returns
//! early or passes silently. `cargo test --lib` runs none of them (the library's unit tests are
//! pure and pass as any user); `cargo test --workspace` (so `make test`) runs them all.
#![allow(dead_code)] // each test target uses some of these

pub mod counter;
pub mod files;
pub mod tar;

use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};

/// Fails unless the test runs as root; `why` says what needs it.
#[track_caller]
pub fn require_root(why: &str) {
    assert!(
        nix::unistd::geteuid().is_root(),
        "cannot run as uid {}: this test {why}, which needs root (run the root_* test targets \
         as root; they never skip)",
        nix::unistd::geteuid()
    );
}

/// The path of `program` on `PATH`; fails if it is not installed.
#[track_caller]
pub fn require_program(program: &str) -> PathBuf {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("cannot run: `{program}` is not installed (not on PATH)"))
}

/// Fails unless the kernel knows the filesystem type `fstype` (`/proc/filesystems`).
#[track_caller]
pub fn require_filesystem(fstype: &str) {
    let known = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    assert!(
        known
            .lines()
            .any(|l| l.split_whitespace().last() == Some(fstype)),
        "cannot run: the kernel has no {fstype} filesystem (/proc/filesystems)"
    );
}

/// Fails unless a filesystem of type `fstype` is mounted at `path`.
#[track_caller]
pub fn require_mount(path: &Path, fstype: &str) {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    assert!(
        mounts.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.get(1).map(Path::new) == Some(path) && f.get(2) == Some(&fstype)
        }),
        "cannot run: no {fstype} mounted at {}",
        path.display()
    );
}

/// A tmpfs of `size` mounted on `dir` (created), unmounted when dropped: a tiny filesystem to
/// run out of space on.
pub struct Tmpfs(PathBuf);

impl Tmpfs {
    #[track_caller]
    pub fn mount(dir: &Path, size: &str) -> Tmpfs {
        require_root("mounts a tmpfs");
        std::fs::create_dir_all(dir).unwrap();
        mount(
            Some("tmpfs"),
            dir,
            Some("tmpfs"),
            MsFlags::empty(),
            Some(format!("size={size}").as_str()),
        )
        .unwrap_or_else(|e| panic!("mount tmpfs on {}: {e}", dir.display()));
        Tmpfs(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = umount2(&self.0, MntFlags::MNT_DETACH);
    }
}

/// Sets xattr `name` of `path` (a symlink is the link itself); panics on failure.
#[track_caller]
pub fn lsetxattr(path: &Path, name: &str, value: &[u8]) {
    use std::{ffi::CString, os::unix::ffi::OsStrExt};
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    let n = CString::new(name).unwrap();
    // SAFETY: `c` and `n` are NUL-terminated strings and `value` is valid for `value.len()`
    // bytes; all outlive the call, and the kernel only reads them.
    let rc = unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if rc != 0 {
        panic!(
            "setxattr {name} on {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        );
    }
}

/// Lets process (or thread) `pid` run on `cpu` only.
#[allow(dead_code)]
pub fn pin(pid: u32, cpu: usize) {
    // SAFETY: an all-zero cpu_set_t is a valid empty set, CPU_SET writes inside it, and
    // sched_setaffinity reads exactly its size from a live local.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        assert_eq!(
            libc::sched_setaffinity(pid as i32, std::mem::size_of_val(&set), &set),
            0
        );
    }
}
