//! The tar writer of filesystem layers: POSIX pax headers over ustar (long names and link
//! targets, big ids and sizes, mtimes with nanoseconds, `SCHILY.xattr.*`, device numbers), GNU
//! sparse 1.0 entries for files with holes, and the OCI whiteout names (`.wh.<name>`,
//! `.wh..wh..opq`). Written by hand (rather than with a tar library) so that one header costs
//! one small buffer and data can be copied into the archive by the kernel.

use std::{
    fs::File,
    io::{self, BufWriter, Write},
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
};

use super::store::StoreError;

const WHITEOUT_PREFIX: &[u8] = b".wh.";
/// The entry that makes a directory opaque (hides every lower layer's content of it).
pub(crate) const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";

/// One tar entry; the fields a kind does not use stay zero/empty.
pub(crate) struct TarEntry<'a> {
    pub name: &'a [u8],
    pub kind: u8,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub mtime: (i64, i64),
    pub link: &'a [u8],
    pub dev: (u32, u32),
    pub xattrs: &'a [(Vec<u8>, Vec<u8>)],
    /// A GNU sparse 1.0 file of this real size; `size` is then the stored map and data.
    pub sparse_size: Option<u64>,
}

impl<'a> TarEntry<'a> {
    pub fn from_stat(name: &'a [u8], kind: u8, st: &libc::stat) -> TarEntry<'a> {
        TarEntry {
            name,
            kind,
            mode: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
            size: 0,
            mtime: (st.st_mtime, st.st_mtime_nsec),
            link: b"",
            dev: (0, 0),
            xattrs: &[],
            sparse_size: None,
        }
    }

    pub fn whiteout(name: &'a [u8]) -> TarEntry<'a> {
        TarEntry {
            name,
            kind: b'0',
            mode: 0,
            uid: 0,
            gid: 0,
            size: 0,
            mtime: (0, 0),
            link: b"",
            dev: (0, 0),
            xattrs: &[],
            sparse_size: None,
        }
    }
}

/// At most this many ranges per id map are shifted ([`IdShift`]); the CRI writes one.
const MAX_ID_RANGES: usize = 5;

/// What is wrong with a `uid_map`/`gid_map` text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdRangeError {
    #[error("{line:?}: {source}")]
    Number {
        line: String,
        #[source]
        source: std::num::ParseIntError,
    },
    #[error("{0:?}: not three numbers")]
    NotThree(String),
    #[error("more than {max} ranges", max = MAX_ID_RANGES)]
    TooMany,
}

/// Why the id maps of a process's user namespace could not be had.
#[derive(Debug, thiserror::Error)]
pub enum IdMapError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: String,
        #[source]
        source: IdRangeError,
    },
}

/// One direction of a user namespace's id map: (inside, outside, count) ranges, as
/// `/proc/PID/uid_map` lists them; none: the identity (the initial user namespace).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IdRanges {
    n: usize,
    ranges: [(u32, u32, u32); MAX_ID_RANGES],
}

impl IdRanges {
    /// Parses a `uid_map`/`gid_map` text. The identity map gives none; a map of more ranges
    /// than crab shifts, or malformed text, is an error.
    pub fn parse(text: &str) -> Result<IdRanges, IdRangeError> {
        let mut out = IdRanges::default();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let f: Vec<u32> = line
                .split_whitespace()
                .map(|n| n.parse::<u32>())
                .collect::<Result<_, _>>()
                .map_err(|source| IdRangeError::Number {
                    line: line.to_string(),
                    source,
                })?;
            let [inside, outside, count] = f[..] else {
                return Err(IdRangeError::NotThree(line.to_string()));
            };
            if (inside, outside, count) == (0, 0, u32::MAX) {
                continue;
            }
            if out.n == MAX_ID_RANGES {
                return Err(IdRangeError::TooMany);
            }
            out.ranges[out.n] = (inside, outside, count);
            out.n += 1;
        }
        Ok(out)
    }

    /// The id inside the namespace of host id `host`; unchanged when no range holds it.
    pub fn inside(&self, host: u32) -> u32 {
        self.ranges[..self.n]
            .iter()
            .find(|(_, outside, count)| host >= *outside && host - outside < *count)
            .map_or(host, |(inside, outside, _)| inside + (host - outside))
    }

    pub fn is_identity(&self) -> bool {
        self.n == 0
    }
}

/// How a layer's owners are shifted from host ids to a user namespace's (the container's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IdShift {
    pub uids: IdRanges,
    pub gids: IdRanges,
}

impl IdShift {
    /// The id maps of `pid`'s user namespace (set by runc before the container ran; a process
    /// cannot change its namespace's maps once written).
    pub fn of_pid(pid: u32) -> Result<IdShift, IdMapError> {
        let read = |what: &str| {
            let path = format!("/proc/{pid}/{what}");
            match std::fs::read_to_string(&path) {
                Ok(t) => IdRanges::parse(&t).map_err(|source| IdMapError::Parse { path, source }),
                Err(source) => Err(IdMapError::Read { path, source }),
            }
        };
        Ok(IdShift {
            uids: read("uid_map")?,
            gids: read("gid_map")?,
        })
    }

    fn is_identity(&self) -> bool {
        self.uids.is_identity() && self.gids.is_identity()
    }
}

/// Writes a tar into a temporary file of the store, counting its bytes and entries. Its errors
/// are the store's (a full disk there is the store's disk).
pub(crate) struct TarWriter {
    out: BufWriter<File>,
    path: PathBuf,
    bytes: u64,
    entries: u64,
    /// Put before every name (and hard link target): the directory a captured tree is at in
    /// the layer (a tracked volume's mount point); empty for the rootfs.
    prefix: Vec<u8>,
    /// Owners are written as these ids.
    ids: IdShift,
}

impl TarWriter {
    pub fn new(out: BufWriter<File>, path: PathBuf) -> Self {
        TarWriter {
            out,
            path,
            bytes: 0,
            entries: 0,
            prefix: Vec::new(),
            ids: IdShift::default(),
        }
    }

    /// Owners from now on are written shifted by `ids` (host ids to the container's).
    pub fn set_ids(&mut self, ids: IdShift) {
        self.ids = ids;
    }

    /// Names from now on are below `dir` (relative, normal components only; empty: the root).
    pub fn set_prefix(&mut self, dir: &Path) {
        self.prefix = dir.as_os_str().as_bytes().to_vec();
    }

    fn prefixed(&self, name: &[u8]) -> Vec<u8> {
        let mut out = self.prefix.clone();
        match name {
            b"./" => out.push(b'/'),
            _ => {
                out.push(b'/');
                out.extend_from_slice(name);
            }
        }
        out
    }

    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// Bytes of the tar so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn err(&self, e: io::Error) -> StoreError {
        StoreError::io("write", &self.path, e)
    }

    pub fn write_raw(&mut self, data: &[u8]) -> Result<(), StoreError> {
        self.out.write_all(data).map_err(|e| self.err(e))?;
        self.bytes += data.len() as u64;
        Ok(())
    }

    pub fn flush(&mut self) -> Result<(), StoreError> {
        self.out.flush().map_err(|e| self.err(e))
    }

    /// The file under the buffer, for data copied into it by the kernel: [`Self::flush`]
    /// first, then [`Self::copied`] with what was added.
    pub fn file(&self) -> &File {
        self.out.get_ref()
    }

    /// Counts `n` bytes written straight to [`Self::file`].
    pub fn copied(&mut self, n: u64) {
        self.bytes += n;
    }

    pub fn append(&mut self, e: &TarEntry) -> Result<(), StoreError> {
        let shifted;
        let e = match self.ids.is_identity() {
            true => e,
            false => {
                shifted = TarEntry {
                    uid: self.ids.uids.inside(e.uid),
                    gid: self.ids.gids.inside(e.gid),
                    ..*e
                };
                &shifted
            }
        };
        let header = match self.prefix.is_empty() {
            true => encode_header(e),
            false => {
                let name = self.prefixed(e.name);
                let link = match e.kind {
                    b'1' => self.prefixed(e.link),
                    _ => e.link.to_vec(),
                };
                encode_header(&TarEntry {
                    name: &name,
                    link: &link,
                    ..*e
                })
            }
        };
        self.write_raw(&header)?;
        self.entries += 1;
        Ok(())
    }

    /// The whiteout of upperdir-relative `rel`.
    pub fn whiteout(&mut self, rel: &Path) -> Result<(), StoreError> {
        self.append(&TarEntry::whiteout(&whiteout_name(rel)))
    }

    /// Zeros after `size` bytes of data, up to the next block.
    pub fn pad(&mut self, size: u64) -> Result<(), StoreError> {
        let rem = (size % 512) as usize;
        if rem != 0 {
            self.write_raw(&[0u8; 512][..512 - rem])?;
        }
        Ok(())
    }

    /// The end-of-archive blocks; returns the tar's length.
    pub fn finish(&mut self) -> Result<u64, StoreError> {
        self.write_raw(&[0u8; 1024])?;
        self.flush()?;
        Ok(self.bytes)
    }
}

/// The blocks preceding an entry's data: a pax extended header where the ustar header cannot
/// say everything (long names, big numbers, sub-second mtimes, xattrs), then the ustar header.
pub(crate) fn encode_header(e: &TarEntry) -> Vec<u8> {
    let mut pax = Vec::new();
    let mut block = [0u8; 512];
    // A sparse file's header carries a placeholder name (as GNU tar's): readers that know the
    // format take the real one from GNU.sparse.name, others extract the map and data there.
    let placeholder;
    let header_name = match e.sparse_size {
        Some(real) => {
            pax_record(&mut pax, b"GNU.sparse.major", b"1");
            pax_record(&mut pax, b"GNU.sparse.minor", b"0");
            pax_record(&mut pax, b"GNU.sparse.name", e.name);
            pax_record(
                &mut pax,
                b"GNU.sparse.realsize",
                real.to_string().as_bytes(),
            );
            let base = e.name.rsplit(|b| *b == b'/').next().unwrap_or(e.name);
            placeholder = [b"GNUSparseFile.0/".as_slice(), &base[..base.len().min(80)]].concat();
            placeholder.as_slice()
        }
        None => e.name,
    };
    match split_ustar_name(header_name) {
        Some((prefix, name)) => {
            block[..name.len()].copy_from_slice(name);
            block[345..345 + prefix.len()].copy_from_slice(prefix);
        }
        None => {
            pax_record(&mut pax, b"path", e.name);
            let n = e.name.len().min(100);
            block[..n].copy_from_slice(&e.name[..n]);
        }
    }
    if e.link.len() <= 100 {
        block[157..157 + e.link.len()].copy_from_slice(e.link);
    } else {
        pax_record(&mut pax, b"linkpath", e.link);
        block[157..257].copy_from_slice(&e.link[..100]);
    }
    octal(&mut block[100..108], u64::from(e.mode));
    for (range, key, v) in [(108..116, "uid", e.uid), (116..124, "gid", e.gid)] {
        if !octal(&mut block[range], u64::from(v)) {
            pax_record(&mut pax, key.as_bytes(), v.to_string().as_bytes());
        }
    }
    if !octal(&mut block[124..136], e.size) {
        pax_record(&mut pax, b"size", e.size.to_string().as_bytes());
    }
    let (secs, nsec) = e.mtime;
    // The header keeps whole seconds where they fit (readers without pax still get those).
    let fits = octal(
        &mut block[136..148],
        u64::try_from(secs).unwrap_or(u64::MAX),
    );
    if !fits {
        octal(&mut block[136..148], 0);
    }
    if !fits || nsec != 0 {
        pax_record(&mut pax, b"mtime", pax_time(secs, nsec).as_bytes());
    }
    block[156] = e.kind;
    block[257..263].copy_from_slice(b"ustar\0");
    block[263..265].copy_from_slice(b"00");
    for (range, key, v) in [
        (329..337, "SCHILY.devmajor", e.dev.0),
        (337..345, "SCHILY.devminor", e.dev.1),
    ] {
        if !octal(&mut block[range], u64::from(v)) {
            pax_record(&mut pax, key.as_bytes(), v.to_string().as_bytes());
        }
    }
    for (name, value) in e.xattrs {
        pax_record(
            &mut pax,
            &[b"SCHILY.xattr.".as_slice(), name].concat(),
            value,
        );
    }
    checksum(&mut block);

    let mut out = Vec::with_capacity(if pax.is_empty() {
        512
    } else {
        1024 + pax.len()
    });
    if !pax.is_empty() {
        let mut xh = [0u8; 512];
        let base = e.name.strip_suffix(b"/").unwrap_or(e.name);
        let base = base.rsplit(|b| *b == b'/').next().unwrap_or(base);
        let xname = [b"PaxHeaders.0/".as_slice(), &base[..base.len().min(87)]].concat();
        xh[..xname.len()].copy_from_slice(&xname);
        octal(&mut xh[100..108], 0o644);
        octal(&mut xh[108..116], 0);
        octal(&mut xh[116..124], 0);
        octal(&mut xh[124..136], pax.len() as u64);
        octal(&mut xh[136..148], 0);
        octal(&mut xh[329..337], 0);
        octal(&mut xh[337..345], 0);
        xh[156] = b'x';
        xh[257..263].copy_from_slice(b"ustar\0");
        xh[263..265].copy_from_slice(b"00");
        checksum(&mut xh);
        out.extend_from_slice(&xh);
        out.extend_from_slice(&pax);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }
    out.extend_from_slice(&block);
    out
}

/// ustar's (prefix, name) split of a path, if it fits.
fn split_ustar_name(path: &[u8]) -> Option<(&[u8], &[u8])> {
    if path.len() <= 100 {
        return Some((b"", path));
    }
    (0..path.len().min(156))
        .rev()
        .filter(|&i| path[i] == b'/')
        .map(|i| (&path[..i], &path[i + 1..]))
        .find(|(_, name)| !name.is_empty() && name.len() <= 100)
}

/// Zero-padded octal and a NUL in `field`; false (field zeroed) if `v` does not fit.
fn octal(field: &mut [u8], v: u64) -> bool {
    let digits = field.len() - 1;
    let s = format!("{v:0digits$o}");
    if s.len() > digits {
        field.fill(0);
        return false;
    }
    field[..digits].copy_from_slice(s.as_bytes());
    field[digits] = 0;
    true
}

fn checksum(block: &mut [u8; 512]) {
    block[148..156].fill(b' ');
    let sum: u32 = block.iter().map(|&b| u32::from(b)).sum();
    block[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
}

/// `<len> <key>=<value>\n`, where `len` counts the whole record including itself.
fn pax_record(out: &mut Vec<u8>, key: &[u8], value: &[u8]) {
    let rest = key.len() + value.len() + 3;
    let mut len = rest + 1;
    while len != rest + len.to_string().len() {
        len = rest + len.to_string().len();
    }
    out.extend_from_slice(len.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(key);
    out.push(b'=');
    out.extend_from_slice(value);
    out.push(b'\n');
}

/// A pax time: seconds and a 9-digit fraction (negative times count down from the epoch).
fn pax_time(secs: i64, nsec: i64) -> String {
    if nsec == 0 {
        return secs.to_string();
    }
    if secs >= 0 {
        return format!("{secs}.{nsec:09}");
    }
    // (secs, nsec) means secs + nsec/1e9: -2 s + 0.5 s is -1.5 s.
    format!("-{}.{:09}", -(secs + 1), 1_000_000_000 - nsec)
}

/// Tar name of an upperdir-relative path (`./` for the root, a trailing `/` for directories).
pub(crate) fn tar_name(rel: &Path, dir: bool) -> Vec<u8> {
    let mut name = rel.as_os_str().as_bytes().to_vec();
    if name.is_empty() {
        return b"./".to_vec();
    }
    if dir {
        name.push(b'/');
    }
    name
}

/// `<rel>/<child>` as a tar name.
pub(crate) fn child_name(rel: &Path, child: &[u8]) -> Vec<u8> {
    let mut name = rel.as_os_str().as_bytes().to_vec();
    if !name.is_empty() {
        name.push(b'/');
    }
    name.extend_from_slice(child);
    name
}

/// `<dir>/.wh.<name>` for upperdir-relative `rel`.
fn whiteout_name(rel: &Path) -> Vec<u8> {
    let parent = rel.parent().unwrap_or(Path::new(""));
    let mut base = WHITEOUT_PREFIX.to_vec();
    base.extend_from_slice(rel.file_name().map(|n| n.as_bytes()).unwrap_or_default());
    child_name(parent, &base)
}

/// The sparse map that starts a GNU sparse 1.0 entry's data: the number of extents, then each
/// extent's offset and length, as decimal lines, padded with NULs to a whole block.
pub(crate) fn sparse_map(extents: &[(u64, u64)]) -> Vec<u8> {
    let mut map = format!("{}\n", extents.len()).into_bytes();
    for (off, len) in extents {
        map.extend_from_slice(format!("{off}\n{len}\n").as_bytes());
    }
    map.resize(map.len().div_ceil(512) * 512, 0);
    map
}

/// The tests' independent tar parser, shared with the root-only tests.
#[cfg(test)]
#[path = "../../tests/support/tar.rs"]
pub(crate) mod test_support;

#[cfg(test)]
mod tests {
    use std::{ffi::CString, fs, process::Command};

    use super::test_support::{names, parse_tar};
    use super::*;
    use crate::sys::xattr;

    /// Every xattr of `p` (not followed), sorted.
    fn lxattrs(p: &Path) -> Vec<(Vec<u8>, Vec<u8>)> {
        let c = CString::new(p.as_os_str().as_bytes()).unwrap();
        let target = xattr::Target::Path(&c);
        let mut out: Vec<(Vec<u8>, Vec<u8>)> = target
            .list()
            .unwrap()
            .split(|b| *b == 0)
            .filter(|n| !n.is_empty())
            .filter_map(|n| {
                let value = target.get(&CString::new(n).unwrap()).unwrap()?;
                Some((n.to_vec(), value))
            })
            .collect();
        out.sort();
        out
    }

    #[test]
    fn pax_records_and_names() {
        for (key, value) in [
            ("a", "b".repeat(2)),
            ("path", "x".repeat(89)),
            ("path", "x".repeat(90)),
            ("path", "x".repeat(992)),
        ] {
            let mut rec = Vec::new();
            pax_record(&mut rec, key.as_bytes(), value.as_bytes());
            let text = String::from_utf8(rec.clone()).unwrap();
            let (len, _) = text.split_once(' ').unwrap();
            assert_eq!(len.parse::<usize>().unwrap(), rec.len(), "{text:?}");
        }
        assert_eq!(pax_time(5, 1), "5.000000001");
        assert_eq!(pax_time(-2, 500_000_000), "-1.500000000");
        assert_eq!(pax_time(-1, 1), "-0.999999999");
        assert_eq!(pax_time(7, 0), "7");
        let long = format!("{}/{}", "p".repeat(150), "n".repeat(100));
        assert_eq!(
            split_ustar_name(long.as_bytes()),
            Some(("p".repeat(150).as_bytes(), "n".repeat(100).as_bytes()))
        );
        assert_eq!(
            split_ustar_name(format!("{}/", "d".repeat(120)).as_bytes()),
            None
        );
        assert_eq!(
            split_ustar_name(format!("a/{}", "n".repeat(101)).as_bytes()),
            None
        );
        assert_eq!(whiteout_name(Path::new("a/b")), b"a/.wh.b");
        assert_eq!(whiteout_name(Path::new("top")), b".wh.top");
        assert_eq!(tar_name(Path::new(""), true), b"./");
    }

    /// Entries beyond ustar's limits read back the same with two independent readers.
    #[test]
    fn pax_entries_read_back() {
        let long_name = format!("{}/{}", "x".repeat(200), "y".repeat(150));
        let long_link = "t".repeat(300);
        // The tar crate splits pax records at newlines (GNU tar and Go honour the lengths):
        // binary values with a newline are checked with GNU tar below.
        let xattrs = vec![(b"user.bin".to_vec(), vec![0u8, 1, 2, b'=', 255])];
        let mut tar = Vec::new();
        let entries = [
            TarEntry {
                name: long_name.as_bytes(),
                kind: b'0',
                mode: 0o4755,
                uid: 3_000_000,
                gid: 7,
                size: 3,
                mtime: (1_700_000_000, 123_456_789),
                link: b"",
                dev: (0, 0),
                xattrs: &xattrs,
                sparse_size: None,
            },
            TarEntry {
                name: b"l",
                kind: b'2',
                mode: 0o777,
                uid: 0,
                gid: 0,
                size: 0,
                mtime: (-2, 500_000_000),
                link: long_link.as_bytes(),
                dev: (0, 0),
                xattrs: &[],
                sparse_size: None,
            },
            TarEntry {
                name: b"d",
                kind: b'3',
                mode: 0o600,
                uid: 0,
                gid: 0,
                size: 0,
                mtime: (1, 0),
                link: b"",
                dev: (4095, 1_048_575),
                xattrs: &[],
                sparse_size: None,
            },
        ];
        for e in &entries {
            tar.extend_from_slice(&encode_header(e));
            if e.size > 0 {
                tar.extend_from_slice(b"abc");
                tar.resize(tar.len().div_ceil(512) * 512, 0);
            }
        }
        tar.extend_from_slice(&[0u8; 1024]);
        let items = parse_tar(&tar);
        assert_eq!(names(&items), vec![long_name.as_str(), "l", "d"]);
        let f = &items[0].1;
        assert_eq!(
            (f.mode, f.uid, f.gid, f.mtime.as_str(), &f.data[..]),
            (0o4755, 3_000_000, 7, "1700000000.123456789", &b"abc"[..])
        );
        assert_eq!(f.xattrs, xattrs);
        assert_eq!(items[1].1.link.as_deref(), Some(long_link.as_bytes()));
        assert_eq!(items[1].1.mtime, "-1.500000000");
        assert_eq!(items[2].1.dev, Some((4095, 1_048_575)));
        // GNU tar agrees.
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("t.tar"), &tar).unwrap();
        let out = Command::new("tar")
            .args(["--numeric-owner", "-tvf"])
            .arg(dir.path().join("t.tar"))
            .output()
            .unwrap();
        let listing = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            listing.contains(&format!("3000000/7 {:>10}", 3)) || listing.contains("3000000/7"),
            "{listing}"
        );
        assert!(
            listing.contains(&long_name) && listing.contains(&long_link),
            "{listing}"
        );

        let value = vec![b'\n', 0, 10, 255, b' ', b'\n'];
        let cap = [(b"user.nl".to_vec(), value.clone())];
        let mut tar = encode_header(&TarEntry {
            name: b"f",
            kind: b'0',
            mode: 0o644,
            uid: 0,
            gid: 0,
            size: 0,
            mtime: (1, 0),
            link: b"",
            dev: (0, 0),
            xattrs: &cap,
            sparse_size: None,
        });
        tar.extend_from_slice(&[0u8; 1024]);
        fs::write(dir.path().join("nl.tar"), &tar).unwrap();
        let out = Command::new("tar")
            .args(["--xattrs", "--xattrs-include=*", "-xf"])
            .arg(dir.path().join("nl.tar"))
            .arg("-C")
            .arg(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(lxattrs(&dir.path().join("f")), cap.to_vec());
    }

    #[test]
    fn id_maps_shift_host_owners_to_the_containers() {
        let m = IdRanges::parse("         0    1000000      65536\n").unwrap();
        assert_eq!((m.inside(1_000_000), m.inside(1_000_005)), (0, 5));
        assert_eq!(
            m.inside(1_065_536),
            1_065_536,
            "outside every range: unchanged"
        );
        assert_eq!(m.inside(0), 0);
        assert!(IdRanges::parse("0 0 4294967295\n").unwrap().is_identity());
        let two = IdRanges::parse("0 2000 10\n100 5000 1\n").unwrap();
        assert_eq!(
            (two.inside(2009), two.inside(5000), two.inside(2010)),
            (9, 100, 2010)
        );
        // Hostile or unexpected text is an error, never a wrong shift.
        for bad in [
            "0 1 x\n",
            "0 1\n",
            "0 1 2 3\n",
            "-1 0 1\n",
            &"0 1 1\n".repeat(6),
        ] {
            assert!(IdRanges::parse(bad).is_err(), "{bad:?}");
        }
        assert!(matches!(
            IdRanges::parse("0 1 x\n"),
            Err(IdRangeError::Number { line, .. }) if line == "0 1 x"
        ));
        assert_eq!(
            IdRanges::parse("0 1\n").unwrap_err().to_string(),
            "\"0 1\": not three numbers"
        );
        assert_eq!(
            IdRanges::parse(&"0 1 1\n".repeat(6)),
            Err(IdRangeError::TooMany)
        );
        let e = IdShift::of_pid(u32::MAX).unwrap_err();
        assert!(
            matches!(&e, IdMapError::Read { path, .. } if path.ends_with("/uid_map")),
            "{e}"
        );
        // The upper dir's host ids become the container's in the headers.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.tar");
        let mut w = TarWriter::new(BufWriter::new(File::create(&path).unwrap()), path.clone());
        w.set_ids(IdShift {
            uids: m,
            gids: IdRanges::parse("0 1000000 65536\n").unwrap(),
        });
        let mut e = TarEntry::whiteout(b"root/note");
        e.uid = 1_000_000;
        e.gid = 1_000_007;
        w.append(&e).unwrap();
        w.flush().unwrap();
        let header = std::fs::read(&path).unwrap();
        // ustar uid (offset 108) and gid (116): octal.
        assert_eq!(&header[108..115], b"0000000");
        assert_eq!(&header[116..123], b"0000007");
    }
}
