//! The mount table of a process, as the kernel prints it in `/proc/PID/mountinfo`: the one
//! parser of it in crab (cgroup hierarchies, the cgroup2 mount, mounts below a directory).
//!
//! The text is hostile input. Mount points, roots and sources are paths that others chose (a
//! container with mount propagation adds mounts to the host's table, a bundle path can hold any
//! byte), so:
//! - the kernel escapes only space, tab, newline and backslash in them (`\ooo`); every other byte
//!   comes through raw, not necessarily UTF-8. The parser works on bytes and keeps paths as
//!   bytes ([`PathBuf`] through `OsStr`), never lossily converted;
//! - fields are separated by exactly one space (an empty source shows as two spaces in a row),
//!   so a line is split on single spaces, never on runs of whitespace;
//! - a line that does not have the documented shape (too few fields, no `-` separator after the
//!   optional fields, a number that is not one) is skipped whole: nothing is guessed from it;
//! - an escape that cannot be one the kernel wrote (`\` not followed by three octal digits of a
//!   byte value) is kept literally;
//! - parsing is linear in the input and never panics, whatever the bytes.
//!
//! Line format (proc(5)): `ID PARENT MAJOR:MINOR ROOT MOUNT_POINT OPTIONS [OPTIONAL...] -
//! FSTYPE SOURCE SUPER_OPTIONS`.

use std::{
    ffi::OsString,
    io,
    os::unix::ffi::{OsStrExt, OsStringExt},
    path::{Path, PathBuf},
};

/// One line of a mount table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub mount_id: u32,
    pub parent_id: u32,
    pub major: u32,
    pub minor: u32,
    /// The directory of the filesystem that is mounted (`/` unless a subtree is bind-mounted;
    /// not always a path: `net:[4026531840]` for a namespace file).
    pub root: PathBuf,
    /// Where it is mounted, relative to the reading process's root.
    pub mount_point: PathBuf,
    /// Per-mount options (`rw,nosuid,relatime`).
    pub options: String,
    /// Optional fields (`shared:5`, `master:1`, ...), in order.
    pub optional: Vec<String>,
    pub fstype: String,
    /// The mount source (a device, `overlay`, `none`, ...); may be empty.
    pub source: OsString,
    /// Superblock options as printed, still escaped: option values may hold escaped commas
    /// (overlayfs' `lowerdir=`), so split with [`Mount::super_options`].
    pub super_options_raw: String,
}

impl Mount {
    /// The superblock options, split on `,` and each unescaped.
    pub fn super_options(&self) -> impl Iterator<Item = String> + '_ {
        self.super_options_raw
            .split(',')
            .filter(|o| !o.is_empty())
            .map(|o| String::from_utf8_lossy(&unescape(o.as_bytes())).into_owned())
    }

    /// The mount point as bytes (for callers comparing raw paths).
    pub fn mount_point_bytes(&self) -> &[u8] {
        self.mount_point.as_os_str().as_bytes()
    }

    /// Whether `option` (e.g. `memory`, `userxattr`) is among the superblock options.
    pub fn has_super_option(&self, option: &str) -> bool {
        self.super_options().any(|o| o == option)
    }
}

/// The mount table of this process (`/proc/self/mountinfo`).
pub fn read_self() -> io::Result<Vec<Mount>> {
    read(Path::new("/proc/self/mountinfo"))
}

/// The mount table in a `mountinfo` file (`/proc/PID/mountinfo`).
pub fn read(path: &Path) -> io::Result<Vec<Mount>> {
    Ok(parse(&std::fs::read(path)?))
}

/// Every well-formed line of a mount table, in order; malformed lines are skipped.
pub fn parse(text: &[u8]) -> Vec<Mount> {
    text.split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .filter_map(parse_line)
        .collect()
}

/// One line (without its newline), or `None` if it does not have the documented shape.
pub fn parse_line(line: &[u8]) -> Option<Mount> {
    let mut fields = line.split(|b| *b == b' ');
    let mount_id = number(fields.next()?)?;
    let parent_id = number(fields.next()?)?;
    let (major, minor) = {
        let dev = fields.next()?;
        let colon = dev.iter().position(|b| *b == b':')?;
        (number(&dev[..colon])?, number(&dev[colon + 1..])?)
    };
    let root = path(fields.next()?)?;
    let mount_point = path(fields.next()?)?;
    let options = text(nonempty(fields.next()?)?);
    let mut optional = Vec::new();
    loop {
        // No separator before the end of the line: not a line to trust.
        let f = fields.next()?;
        if f == b"-" {
            break;
        }
        optional.push(text(nonempty(f)?));
    }
    let fstype = text(nonempty(fields.next()?)?);
    let source = OsString::from_vec(unescape(fields.next()?));
    let super_options_raw = String::from_utf8_lossy(fields.next()?).into_owned();
    if fields.next().is_some() {
        return None;
    }
    Some(Mount {
        mount_id,
        parent_id,
        major,
        minor,
        root,
        mount_point,
        options,
        optional,
        fstype,
        source,
        super_options_raw,
    })
}

fn number(field: &[u8]) -> Option<u32> {
    if field.is_empty() || field.len() > 10 || !field.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(field).ok()?.parse().ok()
}

fn nonempty(field: &[u8]) -> Option<&[u8]> {
    (!field.is_empty()).then_some(field)
}

fn path(field: &[u8]) -> Option<PathBuf> {
    Some(PathBuf::from(OsString::from_vec(unescape(nonempty(
        field,
    )?))))
}

fn text(field: &[u8]) -> String {
    String::from_utf8_lossy(&unescape(field)).into_owned()
}

/// Undoes the kernel's `\ooo` escapes (of space, tab, newline and backslash). A backslash that
/// does not start three octal digits of a byte (at most `\377`) is kept as it is.
pub fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        if field[i] == b'\\' {
            if let Some(&[a, b, c]) = field.get(i + 1..i + 4) {
                let octal = |d: u8| (b'0'..=b'7').contains(&d);
                if (b'0'..=b'3').contains(&a) && octal(b) && octal(c) {
                    out.push((a - b'0') * 64 + (b - b'0') * 8 + (c - b'0'));
                    i += 4;
                    continue;
                }
            }
        }
        out.push(field[i]);
        i += 1;
    }
    out
}

/// Detaches every mount at or below `dir` in this process's mount namespace, deepest first
/// (stacked mounts each once); returns how many were detached. A mount that cannot be detached
/// is logged and left.
pub fn detach_all_under(dir: &Path) -> usize {
    let mounts = read_self().unwrap_or_default();
    let mut detached = 0;
    for p in mount_points_under(&mounts, dir) {
        match nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH) {
            Ok(()) => detached += 1,
            Err(e) => log::warn!("cannot unmount {}: {e}", p.display()),
        }
    }
    detached
}

/// Mount points at or below `dir` (by path components), deepest first: the order to unmount
/// them in.
pub fn mount_points_under(mounts: &[Mount], dir: &Path) -> Vec<PathBuf> {
    let mut points: Vec<PathBuf> = mounts
        .iter()
        .filter(|m| m.mount_point.starts_with(dir))
        .map(|m| m.mount_point.clone())
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
25 22 0:22 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
27 25 0:24 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:11 - cgroup cgroup rw,cpu,cpuacct
40 22 0:40 / /run/containerd/io.containerd.runtime.v2.task/default/c1/rootfs rw,relatime - overlay overlay rw,lowerdir=/l/1/fs:/l/2/fs,upperdir=/l/3/fs,workdir=/l/3/work,userxattr
41 22 0:4 net:[4026532281] /run/netns/cni-1 rw shared:200 - nsfs nsfs rw
";

    #[test]
    fn parses_every_field_of_a_host_table() {
        let m = parse(HOST.as_bytes());
        assert_eq!(m.len(), 6);
        assert_eq!(
            m[0],
            Mount {
                mount_id: 22,
                parent_id: 1,
                major: 8,
                minor: 1,
                root: "/".into(),
                mount_point: "/".into(),
                options: "rw,relatime".into(),
                optional: vec!["shared:1".into()],
                fstype: "ext4".into(),
                source: "/dev/sda1".into(),
                super_options_raw: "rw,errors=remount-ro".into(),
            }
        );
        assert_eq!(m[2].fstype, "cgroup2");
        assert_eq!(m[2].mount_point, Path::new("/sys/fs/cgroup/unified"));
        assert!(m[3].has_super_option("cpuacct") && !m[3].has_super_option("memory"));
        assert!(m[4].has_super_option("userxattr"));
        assert!(m[4].optional.is_empty());
        assert_eq!(m[5].root, Path::new("net:[4026532281]"));
    }

    #[test]
    fn escapes_are_undone_in_paths_and_kept_when_not_the_kernels() {
        let line = br"30 1 0:26 /sub\040dir /mnt/cg\040v2\011tab\012nl\134bs rw - cgroup2 none rw";
        let m = parse_line(line).unwrap();
        assert_eq!(m.root, Path::new("/sub dir"));
        assert_eq!(m.mount_point, Path::new("/mnt/cg v2\ttab\nnl\\bs"));
        // Not escapes the kernel writes: kept byte for byte (and \777 is no byte: no overflow).
        for (raw, want) in [
            (&br"/a\777"[..], &b"/a\\777"[..]),
            (br"/a\08", br"/a\08"),
            (br"/a\04", br"/a\04"),
            (br"/a\\", br"/a\\"),
            (br"/a\x41", br"/a\x41"),
            (br"\", br"\"),
        ] {
            assert_eq!(unescape(raw), want, "{}", String::from_utf8_lossy(raw));
        }
        // Escaped commas inside a superblock option value stay inside it.
        let m =
            parse_line(br"40 1 0:40 / /m rw - overlay overlay rw,lowerdir=/a\054b:/c,upperdir=/u")
                .unwrap();
        assert_eq!(
            m.super_options().collect::<Vec<_>>(),
            ["rw", "lowerdir=/a,b:/c", "upperdir=/u"]
        );
    }

    #[test]
    fn raw_bytes_that_are_not_utf8_survive_in_paths() {
        let mut line = b"50 22 0:50 / /run/crab/\xff\xfe rw - tmpfs tmpfs rw".to_vec();
        let m = parse_line(&line).unwrap();
        assert_eq!(m.mount_point_bytes(), b"/run/crab/\xff\xfe");
        // The whole table still parses around such a line.
        line.push(b'\n');
        line.extend_from_slice(HOST.as_bytes());
        assert_eq!(parse(&line).len(), 7);
    }

    #[test]
    fn optional_fields_any_number_and_empty_source() {
        let m = parse_line(
            b"60 22 0:60 / /a rw shared:3 master:1 propagate_from:2 unbindable - tmpfs  rw",
        )
        .unwrap();
        assert_eq!(
            m.optional,
            ["shared:3", "master:1", "propagate_from:2", "unbindable"]
        );
        assert_eq!(m.fstype, "tmpfs");
        assert_eq!(m.source, OsString::new());
        assert_eq!(m.super_options_raw, "rw");
    }

    #[test]
    fn malformed_lines_are_skipped_never_guessed() {
        for bad in [
            // No separator: the optional fields never end.
            &b"22 1 8:1 / / rw shared:1 ext4 /dev/sda1 rw"[..],
            b"22 1 8:1 / / rw shared:1 - ext4",
            // A separator that is not its own field.
            b"22 1 8:1 / / rw shared:1 -ext4 /dev/sda1 rw",
            // Too few fields, bad numbers, bad device, empty path fields.
            b"22 1 8:1 / /",
            b"x 1 8:1 / / rw - ext4 /dev/sda1 rw",
            b"-1 1 8:1 / / rw - ext4 /dev/sda1 rw",
            b"99999999999 1 8:1 / / rw - ext4 /dev/sda1 rw",
            b"22 1 8-1 / / rw - ext4 /dev/sda1 rw",
            b"22 1 8:1  / rw - ext4 /dev/sda1 rw",
            b"22  1 8:1 / / rw - ext4 /dev/sda1 rw",
            b"22 1 8:1 / / rw -  /dev/sda1 rw",
            // Fields beyond the superblock options (a space the kernel would have escaped).
            b"22 1 8:1 / / rw - ext4 /dev/sda1 rw extra",
            b"",
            b" ",
            b"\0\0\0",
        ] {
            assert_eq!(parse_line(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
        // Skipped lines do not disturb their neighbours.
        let table = [
            "garbage without shape\n",
            HOST,
            "22 1 8:1 / / rw shared:1 ext4 /dev/sda1 rw\n\n\n",
        ]
        .concat();
        assert_eq!(parse(table.as_bytes()).len(), 6);
    }

    #[test]
    fn huge_lines_parse_in_linear_time() {
        // A mount point of 1 MiB of escapes, and 100,000 optional fields.
        let point = r"/x\040".repeat(1 << 18);
        let line = format!("70 22 0:70 / {point} rw - tmpfs tmpfs rw");
        let started = std::time::Instant::now();
        let m = parse_line(line.as_bytes()).unwrap();
        assert_eq!(m.mount_point.as_os_str().len(), 3 << 18);
        let optional = "shared:1 ".repeat(100_000);
        let line = format!("71 22 0:71 / /m rw {optional}- tmpfs tmpfs rw");
        assert_eq!(parse_line(line.as_bytes()).unwrap().optional.len(), 100_000);
        // A huge line without its separator is refused just as fast.
        let line = format!("72 22 0:72 / /m rw {optional}");
        assert_eq!(parse_line(line.as_bytes()), None);
        assert!(
            started.elapsed() < std::time::Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn mount_points_under_a_directory_deepest_first() {
        let table = "\
1 0 0:1 / /run rw - tmpfs tmpfs rw
2 1 0:2 / /run/b rw - tmpfs tmpfs rw
3 2 0:3 / /run/b/rootfs rw - overlay overlay rw
4 3 0:4 / /run/b/rootfs/proc rw - proc proc rw
5 1 0:5 / /run/b2 rw - tmpfs tmpfs rw
6 1 0:6 / /run/b\\040c rw - tmpfs tmpfs rw
";
        let mounts = parse(table.as_bytes());
        assert_eq!(
            mount_points_under(&mounts, Path::new("/run/b")),
            [
                PathBuf::from("/run/b/rootfs/proc"),
                "/run/b/rootfs".into(),
                "/run/b".into()
            ]
        );
        assert_eq!(
            mount_points_under(&mounts, Path::new("/run/b c")),
            [PathBuf::from("/run/b c")]
        );
    }

    #[test]
    fn reads_this_process_table() {
        let mounts = read_self().unwrap();
        assert!(
            mounts.iter().any(|m| m.mount_point == Path::new("/")),
            "{mounts:?}"
        );
    }
}
