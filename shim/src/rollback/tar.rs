//! A reader of crab's own fs layers (what [`crate::checkpoint::tar`] writes: ustar headers,
//! pax extended headers, GNU sparse 1.0 entries, OCI whiteouts), for an in-place rollback.
//!
//! The layers come from the store, whose files are a trust boundary like any other (a blob may
//! be damaged, or written by something else): every header is checked (checksum, octal or
//! base-256 numbers, sizes within bounds), names are normalized and refused if they climb
//! (`..`), pax headers and sparse maps are bounded, and an entry type the writer never produces
//! is an error. The blob's digest is checked against its descriptor over the whole stream.

use std::{
    ffi::OsStr,
    io::{self, Read},
    os::unix::ffi::OsStrExt,
    path::{Component, Path, PathBuf},
};

/// At most this many bytes of pax extended header per entry.
const MAX_PAX: u64 = 1 << 20;
/// At most this many bytes of one path or link target.
const MAX_NAME: usize = 64 << 10;
/// At most this many extents in one sparse map.
const MAX_SPARSE_EXTENTS: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum TarError {
    #[error("reading the layer: {0}")]
    Io(#[from] io::Error),
    #[error("damaged layer at byte {offset}: {why}")]
    Bad {
        offset: u64,
        #[source]
        why: Damage,
    },
}

/// What is wrong with a layer's tar (at the entry [`TarError::Bad`] names).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Damage {
    #[error("no end-of-archive blocks")]
    NoEnd,
    #[error("header checksum {want} but the header sums to {sum}")]
    Checksum { want: u64, sum: u64 },
    #[error("checksum field: {0}")]
    ChecksumField(#[source] NumberError),
    #[error("size: {0}")]
    Size(#[source] NumberError),
    #[error(transparent)]
    Number(#[from] NumberError),
    #[error("an extended header of {0} bytes")]
    ExtendedHeader(u64),
    #[error("more than {0} entries")]
    TooManyEntries(u64),
    #[error("a name or link target too long")]
    NameTooLong,
    #[error("pax {key}: {value:?}")]
    PaxNumber { key: String, value: Vec<u8> },
    #[error("{0} too large")]
    IdTooLarge(String),
    #[error("entry type {0:?}")]
    EntryType(char),
    #[error("{0:?} ends in a slash")]
    TrailingSlash(String),
    #[error("the name {0:?} climbs")]
    Climbs(PathBuf),
    #[error("a name with a NUL")]
    Nul,
    #[error("a whiteout without a name")]
    EmptyWhiteout,
    #[error("a pax record without a length")]
    PaxNoLength,
    #[error("a pax record length that is not a number")]
    PaxBadLength,
    #[error("a pax record of a wrong length")]
    PaxWrongLength,
    #[error("a pax record without '='")]
    PaxNoEquals,
    #[error("a pax mtime that is not text")]
    MtimeNotText,
    #[error("pax mtime {0:?}")]
    Mtime(String),
    #[error("a sparse file without its real size")]
    SparseNoRealSize,
    #[error("a sparse map out of order or beyond the size")]
    SparseOrder,
    #[error("a sparse entry whose data does not match its map")]
    SparseMismatch,
    #[error("sparse format {0:?}")]
    SparseFormat(String),
    #[error("a sparse map longer than its entry")]
    SparseMapTooLong,
    #[error("the layer ends inside a sparse map")]
    SparseMapCutShort,
    #[error("a sparse map that is not numbers")]
    SparseMapNotNumbers,
    #[error("a sparse map of too many extents")]
    SparseMapTooManyExtents,
    /// A hard link to a path the layers hold no file at (read by [`super::state`]).
    #[error("{} links to {}, which is no file of the layers", path.display(), link.display())]
    DanglingLink { path: PathBuf, link: PathBuf },
}

/// What is wrong with a number field of a tar header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NumberError {
    #[error("a base-256 number too large")]
    Base256TooLarge,
    #[error("not octal")]
    NotText,
    #[error("{0:?} is not octal")]
    NotOctal(String),
}

/// What an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    /// A hard link to another entry of the same layer (its `link`).
    Hardlink,
    Symlink,
    CharDev,
    BlockDev,
    Dir,
    Fifo,
}

/// One entry's header, its name made a normalized relative path (`""`: the root).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub path: PathBuf,
    pub kind: Kind,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: (i64, i64),
    /// Symlink target (as stored), or hard link target (a normalized relative path).
    pub link: PathBuf,
    pub dev: (u32, u32),
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    /// The file's size (a sparse file's real size).
    pub size: u64,
    /// A sparse file's data extents (offset, length), in order; its data is their bytes,
    /// one after the other.
    pub sparse: Option<Vec<(u64, u64)>>,
}

/// What a layer entry stands for once the OCI whiteout names are read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    Entry(Header),
    /// `<dir>/.wh.<name>`: `<dir>/<name>` is deleted.
    Whiteout(PathBuf),
    /// `<dir>/.wh..wh..opq`: the older content of `<dir>` is hidden.
    Opaque(PathBuf),
}

/// Where an entry's data is in the uncompressed tar: `len` bytes from `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DataAt {
    pub offset: u64,
    pub len: u64,
}

/// A reader that counts what it has read.
struct Counted<R> {
    inner: R,
    at: u64,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.at += n as u64;
        Ok(n)
    }
}

impl<R: Read> Counted<R> {
    fn skip(&mut self, n: u64) -> io::Result<()> {
        let copied = io::copy(&mut (&mut *self).take(n), &mut io::sink())?;
        if copied != n {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the layer ends inside an entry",
            ));
        }
        Ok(())
    }

    fn block(&mut self) -> io::Result<Option<[u8; 512]>> {
        let mut b = [0u8; 512];
        let mut got = 0;
        while got < 512 {
            match self.read(&mut b[got..])? {
                0 if got == 0 => return Ok(None),
                0 => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the layer ends inside a header",
                    ))
                }
                n => got += n,
            }
        }
        Ok(Some(b))
    }
}

/// Reads every entry of the uncompressed tar `r`, calling `visit` with each item and, for a
/// regular file (sparse or not), where its data is. At most `max_entries` entries.
pub fn read(
    r: impl Read,
    max_entries: u64,
    mut visit: impl FnMut(Item, Option<DataAt>) -> Result<(), TarError>,
) -> Result<(), TarError> {
    let mut r = Counted { inner: r, at: 0 };
    let mut entries = 0u64;
    let mut pax: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let mut long_name: Option<Vec<u8>> = None;
    let mut long_link: Option<Vec<u8>> = None;
    loop {
        let at = r.at;
        let bad = |why: Damage| TarError::Bad { offset: at, why };
        let Some(block) = r.block()? else {
            return Err(bad(Damage::NoEnd));
        };
        if block.iter().all(|&b| b == 0) {
            return Ok(());
        }
        check_sum(&block).map_err(bad)?;
        let typeflag = block[156];
        let size = number(&block[124..136]).map_err(|e| bad(Damage::Size(e)))?;
        match typeflag {
            b'x' | b'g' | b'L' | b'K' => {
                if size > MAX_PAX {
                    return Err(bad(Damage::ExtendedHeader(size)));
                }
                let mut data = vec![0u8; size as usize];
                r.read_exact(&mut data)?;
                r.skip(pad(size))?;
                match typeflag {
                    b'x' => pax = parse_pax(&data).map_err(bad)?,
                    b'L' => long_name = Some(trim_nul(&data).to_vec()),
                    b'K' => long_link = Some(trim_nul(&data).to_vec()),
                    _ => {}
                }
                continue;
            }
            _ => {}
        }
        entries += 1;
        if entries > max_entries {
            return Err(bad(Damage::TooManyEntries(max_entries)));
        }
        let ext = std::mem::take(&mut pax);
        let (long_name, long_link) = (long_name.take(), long_link.take());
        let (mut header, stored) = entry_header(&block, &ext, long_name, long_link).map_err(bad)?;
        let data = match header.kind {
            Kind::File => file_data(&mut r, &mut header, &ext, stored).map_err(|e| match e {
                TarError::Bad { why, .. } => bad(why),
                e => e,
            })?,
            _ => {
                // Only regular files carry data here.
                r.skip(stored)?;
                None
            }
        };
        r.skip(pad(stored))?;
        visit(item_of(header).map_err(bad)?, data)?;
    }
}

/// The value of the last pax record `key` of an entry's extended header.
fn pax_get<'a>(ext: &'a [(Vec<u8>, Vec<u8>)], key: &[u8]) -> Option<&'a Vec<u8>> {
    ext.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v)
}

/// The header of an entry from its ustar `block` and what preceded it (pax records `ext`, GNU
/// long name and link), with the size of its data as stored in the layer.
fn entry_header(
    block: &[u8; 512],
    ext: &[(Vec<u8>, Vec<u8>)],
    long_name: Option<Vec<u8>>,
    long_link: Option<Vec<u8>>,
) -> Result<(Header, u64), Damage> {
    let get = |key: &[u8]| pax_get(ext, key);
    let ustar = &block[257..262] == b"ustar";
    let mut name = match (get(b"GNU.sparse.name"), get(b"path"), long_name) {
        (Some(n), _, _) | (None, Some(n), _) => n.clone(),
        (None, None, Some(n)) => n,
        (None, None, None) => {
            let base = trim_nul(&block[..100]);
            let prefix = if ustar {
                trim_nul(&block[345..500])
            } else {
                b""
            };
            match prefix.is_empty() {
                true => base.to_vec(),
                false => [prefix, b"/", base].concat(),
            }
        }
    };
    let link = match (get(b"linkpath"), long_link) {
        (Some(l), _) => l.clone(),
        (None, Some(l)) => l,
        (None, None) => trim_nul(&block[157..257]).to_vec(),
    };
    if name.len() > MAX_NAME || link.len() > MAX_NAME {
        return Err(Damage::NameTooLong);
    }
    let num = |key: &[u8], field: &[u8]| -> Result<u64, Damage> {
        match get(key) {
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| Damage::PaxNumber {
                    key: String::from_utf8_lossy(key).into_owned(),
                    value: v.clone(),
                }),
            None => Ok(number(field)?),
        }
    };
    let id = |key: &[u8], field: &[u8]| -> Result<u32, Damage> {
        u32::try_from(num(key, field)?)
            .map_err(|_| Damage::IdTooLarge(String::from_utf8_lossy(key).into_owned()))
    };
    let stored = num(b"size", &block[124..136])?;
    let mtime = match get(b"mtime") {
        Some(v) => parse_time(v)?,
        None => (number(&block[136..148])? as i64, 0),
    };
    let kind = match block[156] {
        b'0' | b'\0' | b'7' => Kind::File,
        b'1' => Kind::Hardlink,
        b'2' => Kind::Symlink,
        b'3' => Kind::CharDev,
        b'4' => Kind::BlockDev,
        b'5' => Kind::Dir,
        b'6' => Kind::Fifo,
        other => return Err(Damage::EntryType(other as char)),
    };
    // A directory's name may end in a slash; a file's must not.
    if kind != Kind::Dir && name.ends_with(b"/") && name != b"./" {
        return Err(Damage::TrailingSlash(
            String::from_utf8_lossy(&name).into_owned(),
        ));
    }
    while name.len() > 1 && name.ends_with(b"/") {
        name.pop();
    }
    let xattrs: Vec<(Vec<u8>, Vec<u8>)> = ext
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(b"SCHILY.xattr.")?.to_vec(), v.clone())))
        .collect();
    let mut header = Header {
        path: normalize(&name)?,
        kind,
        mode: (number(&block[100..108])? & 0o7777) as u32,
        uid: id(b"uid", &block[108..116])?,
        gid: id(b"gid", &block[116..124])?,
        mtime,
        link: PathBuf::from(OsStr::from_bytes(&link)),
        dev: (
            id(b"SCHILY.devmajor", &block[329..337])?,
            id(b"SCHILY.devminor", &block[337..345])?,
        ),
        xattrs,
        size: 0,
        sparse: None,
    };
    if kind == Kind::Hardlink {
        header.link = normalize(&link)?;
    }
    Ok((header, stored))
}

/// Where a regular file's data is (after its sparse map, for a GNU sparse 1.0 entry), its size
/// and map set in `header`; `r` is left after the data (before the padding).
fn file_data<R: Read>(
    r: &mut Counted<R>,
    header: &mut Header,
    ext: &[(Vec<u8>, Vec<u8>)],
    stored: u64,
) -> Result<Option<DataAt>, TarError> {
    // The caller puts the entry's offset in.
    let bad = |why: Damage| TarError::Bad { offset: 0, why };
    match pax_get(ext, b"GNU.sparse.major").map(Vec::as_slice) {
        None => {
            header.size = stored;
            let data = DataAt {
                offset: r.at,
                len: stored,
            };
            r.skip(stored)?;
            Ok(Some(data))
        }
        Some(b"1") => {
            let real = pax_get(ext, b"GNU.sparse.realsize")
                .and_then(|v| std::str::from_utf8(v).ok()?.parse::<u64>().ok())
                .ok_or_else(|| bad(Damage::SparseNoRealSize))?;
            let (map, map_len) = read_sparse_map(r, stored)?;
            let data_len: u64 = map.iter().map(|(_, l)| l).sum();
            let mut end = 0u64;
            for &(o, l) in &map {
                if o < end || o.checked_add(l).is_none_or(|e| e > real) {
                    return Err(bad(Damage::SparseOrder));
                }
                end = o + l;
            }
            if map_len + data_len != stored {
                return Err(bad(Damage::SparseMismatch));
            }
            header.size = real;
            header.sparse = Some(map);
            let data = DataAt {
                offset: r.at,
                len: data_len,
            };
            r.skip(data_len)?;
            Ok(Some(data))
        }
        Some(v) => Err(bad(Damage::SparseFormat(
            String::from_utf8_lossy(v).into_owned(),
        ))),
    }
}

/// What an entry is in a layer: an opaque-directory marker, a whiteout, or itself.
fn item_of(header: Header) -> Result<Item, Damage> {
    Ok(match header.path.file_name().map(|n| n.as_bytes()) {
        Some(b".wh..wh..opq") => Item::Opaque(parent(&header.path)),
        Some(n) if n.starts_with(b".wh.") => {
            let hidden = OsStr::from_bytes(&n[4..]);
            if hidden.is_empty() || hidden == "." || hidden == ".." {
                return Err(Damage::EmptyWhiteout);
            }
            Item::Whiteout(parent(&header.path).join(hidden))
        }
        _ => Item::Entry(header),
    })
}

fn parent(p: &Path) -> PathBuf {
    p.parent().map(Path::to_path_buf).unwrap_or_default()
}

/// The sparse map at the start of a GNU sparse 1.0 entry's data: decimal lines (count, then
/// offset and length per extent), padded to a block. Returns it and its length with the padding.
fn read_sparse_map(
    r: &mut Counted<impl Read>,
    stored: u64,
) -> Result<(Vec<(u64, u64)>, u64), TarError> {
    let bad = |why: Damage| TarError::Bad { offset: 0, why };
    let mut text: Vec<u8> = Vec::new();
    let mut numbers: Vec<u64> = Vec::new();
    let mut want: Option<u64> = None;
    let mut consumed = 0u64;
    loop {
        if consumed + 512 > stored {
            return Err(bad(Damage::SparseMapTooLong));
        }
        let block = r.block()?.ok_or_else(|| bad(Damage::SparseMapCutShort))?;
        consumed += 512;
        for &b in block.iter() {
            if want.is_some_and(|n| numbers.len() as u64 == 1 + 2 * n) {
                break;
            }
            if b == b'\n' {
                let n = std::str::from_utf8(&text)
                    .ok()
                    .and_then(|s| s.parse::<u64>().ok())
                    .ok_or_else(|| bad(Damage::SparseMapNotNumbers))?;
                text.clear();
                if numbers.is_empty() {
                    if n > MAX_SPARSE_EXTENTS {
                        return Err(bad(Damage::SparseMapTooManyExtents));
                    }
                    want = Some(n);
                }
                numbers.push(n);
            } else if b.is_ascii_digit() && text.len() < 20 {
                text.push(b);
            } else {
                return Err(bad(Damage::SparseMapNotNumbers));
            }
        }
        if let Some(n) = want {
            if numbers.len() as u64 == 1 + 2 * n {
                let map = numbers[1..].chunks(2).map(|c| (c[0], c[1])).collect();
                return Ok((map, consumed));
            }
        }
    }
}

/// A tar name as a relative path of normal components (`./` and `/` are the root); `..`, or a
/// NUL, is refused.
pub fn normalize(name: &[u8]) -> Result<PathBuf, Damage> {
    let p = Path::new(OsStr::from_bytes(name));
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(n) => out.push(n),
            Component::ParentDir | Component::Prefix(_) => {
                return Err(Damage::Climbs(p.to_path_buf()))
            }
        }
    }
    if name.contains(&0) {
        return Err(Damage::Nul);
    }
    Ok(out)
}

fn trim_nul(b: &[u8]) -> &[u8] {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    &b[..end]
}

fn pad(size: u64) -> u64 {
    (512 - size % 512) % 512
}

fn check_sum(block: &[u8; 512]) -> Result<(), Damage> {
    let want = number(&block[148..156]).map_err(Damage::ChecksumField)?;
    let sum: u64 = block
        .iter()
        .enumerate()
        .map(|(i, &b)| {
            if (148..156).contains(&i) {
                32
            } else {
                u64::from(b)
            }
        })
        .sum();
    match sum == want {
        true => Ok(()),
        false => Err(Damage::Checksum { want, sum }),
    }
}

/// An octal field (NUL/space padded), or a base-256 one (high bit of the first byte set).
fn number(field: &[u8]) -> Result<u64, NumberError> {
    if field.first().is_some_and(|b| b & 0x80 != 0) {
        let mut v: u64 = u64::from(field[0] & 0x7f);
        for &b in &field[1..] {
            v = v
                .checked_mul(256)
                .and_then(|v| v.checked_add(u64::from(b)))
                .ok_or(NumberError::Base256TooLarge)?;
        }
        return Ok(v);
    }
    let digits: &[u8] = {
        let t = trim_nul(field);
        let start = t.iter().position(|&b| b != b' ').unwrap_or(t.len());
        let end = t.iter().rposition(|&b| b != b' ').map_or(start, |e| e + 1);
        &t[start..end.max(start)]
    };
    if digits.is_empty() {
        return Ok(0);
    }
    let s = std::str::from_utf8(digits).map_err(|_| NumberError::NotText)?;
    u64::from_str_radix(s, 8).map_err(|_| NumberError::NotOctal(s.to_string()))
}

/// (key, value) pairs: pax records, xattrs.
pub type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

/// pax records: `<len> <key>=<value>\n`.
fn parse_pax(mut data: &[u8]) -> Result<Pairs, Damage> {
    let mut out = Vec::new();
    while !data.is_empty() {
        if data.iter().all(|&b| b == 0) {
            break;
        }
        let sp = data
            .iter()
            .position(|&b| b == b' ')
            .filter(|&i| i <= 20)
            .ok_or(Damage::PaxNoLength)?;
        let len: usize = std::str::from_utf8(&data[..sp])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or(Damage::PaxBadLength)?;
        if len <= sp + 1 || len > data.len() || data[len - 1] != b'\n' {
            return Err(Damage::PaxWrongLength);
        }
        let record = &data[sp + 1..len - 1];
        let eq = record
            .iter()
            .position(|&b| b == b'=')
            .ok_or(Damage::PaxNoEquals)?;
        out.push((record[..eq].to_vec(), record[eq + 1..].to_vec()));
        data = &data[len..];
    }
    Ok(out)
}

/// A pax time: seconds, optionally negative, with an optional fraction.
fn parse_time(v: &[u8]) -> Result<(i64, i64), Damage> {
    let s = std::str::from_utf8(v).map_err(|_| Damage::MtimeNotText)?;
    let (neg, s) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    let (secs, frac) = s.split_once('.').unwrap_or((s, ""));
    let bad = || Damage::Mtime(s.to_string());
    let secs: i64 = secs.parse().map_err(|_| bad())?;
    if frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let nsec: i64 = match frac.is_empty() {
        true => 0,
        false => format!("{frac:0<9}").parse().map_err(|_| bad())?,
    };
    Ok(match (neg, nsec) {
        (false, _) => (secs, nsec),
        (true, 0) => (-secs, 0),
        (true, n) => (-secs - 1, 1_000_000_000 - n),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ustar(name: &str, typeflag: u8, size: u64) -> Vec<u8> {
        let mut b = [0u8; 512];
        b[..name.len()].copy_from_slice(name.as_bytes());
        b[100..107].copy_from_slice(b"0000644");
        b[108..115].copy_from_slice(b"0000000");
        b[116..123].copy_from_slice(b"0000000");
        b[124..135].copy_from_slice(format!("{size:011o}").as_bytes());
        b[136..147].copy_from_slice(b"00000000000");
        b[156] = typeflag;
        b[257..263].copy_from_slice(b"ustar\0");
        b[263..265].copy_from_slice(b"00");
        b[148..156].fill(b' ');
        let sum: u32 = b.iter().map(|&x| u32::from(x)).sum();
        b[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        b.to_vec()
    }

    fn items(tar: &[u8]) -> Result<Vec<(Item, Option<DataAt>)>, TarError> {
        let mut out = Vec::new();
        read(tar, 100, |i, d| {
            out.push((i, d));
            Ok(())
        })?;
        Ok(out)
    }

    #[test]
    fn hostile_headers_are_refused_not_followed() {
        let end = [0u8; 1024];
        // A name that climbs out.
        let tar = [ustar("../etc/passwd", b'0', 0), end.to_vec()].concat();
        assert!(matches!(items(&tar), Err(TarError::Bad { .. })));
        // A hard link whose target climbs out.
        let mut h = ustar("a", b'1', 0);
        h[157..170].copy_from_slice(b"../../secret\0");
        h[148..156].fill(b' ');
        let sum: u32 = h.iter().map(|&x| u32::from(x)).sum();
        h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        assert!(items(&[h, end.to_vec()].concat()).is_err());
        // A bad checksum, a truncated layer, no end blocks, an unknown type, a huge pax header.
        let mut h = ustar("a", b'0', 0);
        h[0] = b'b';
        assert!(items(&[h, end.to_vec()].concat()).is_err());
        assert!(items(&ustar("a", b'0', 100)).is_err());
        assert!(items(&ustar("a", b'0', 0)).is_err());
        assert!(items(&[ustar("a", b'S', 0), end.to_vec()].concat()).is_err());
        assert!(items(&[ustar("p", b'x', 1 << 30), end.to_vec()].concat()).is_err());
        // More entries than allowed.
        let many: Vec<u8> = (0..101)
            .flat_map(|i| ustar(&format!("f{i}"), b'0', 0))
            .chain(end)
            .collect();
        assert!(items(&many)
            .unwrap_err()
            .to_string()
            .contains("more than 100"));
    }

    #[test]
    fn whiteouts_opaque_markers_and_data_offsets() {
        let end = [0u8; 1024];
        let mut data = b"hello".to_vec();
        data.resize(512, 0);
        let tar = [
            ustar("./", b'5', 0),
            ustar("app/", b'5', 0),
            ustar("app/.wh..wh..opq", b'0', 0),
            ustar("app/.wh.gone", b'0', 0),
            ustar("app/x", b'0', 5),
            data,
            end.to_vec(),
        ]
        .concat();
        let got = items(&tar).unwrap();
        assert!(
            matches!(&got[0].0, Item::Entry(h) if h.path == Path::new("") && h.kind == Kind::Dir)
        );
        assert_eq!(got[2].0, Item::Opaque(PathBuf::from("app")));
        assert_eq!(got[3].0, Item::Whiteout(PathBuf::from("app/gone")));
        let (Item::Entry(h), Some(at)) = &got[4] else {
            panic!("{:?}", got[4]);
        };
        assert_eq!((h.path.as_path(), h.size), (Path::new("app/x"), 5));
        assert_eq!(&tar[at.offset as usize..][..5], b"hello");
    }

    #[test]
    fn pax_times_and_numbers() {
        assert_eq!(parse_time(b"12.5").unwrap(), (12, 500_000_000));
        assert_eq!(parse_time(b"-1.5").unwrap(), (-2, 500_000_000));
        assert_eq!(parse_time(b"7").unwrap(), (7, 0));
        assert!(parse_time(b"1.1234567890").is_err());
        assert_eq!(number(b"0000644\0").unwrap(), 0o644);
        assert_eq!(number(&[0x80, 0, 0, 1, 0]).unwrap(), 256);
        assert!(number(b"99\0").is_err());
        assert_eq!(
            parse_pax(b"11 path=a\n13 x=a=b\nc\n").unwrap_err(),
            Damage::PaxWrongLength
        );
        assert_eq!(
            number(b"99\0").unwrap_err().to_string(),
            "\"99\" is not octal"
        );
        assert_eq!(
            number(&[0xff; 12]).unwrap_err(),
            NumberError::Base256TooLarge
        );
        assert_eq!(parse_time(b"x.5").unwrap_err(), Damage::Mtime("x.5".into()));
        let recs = parse_pax(b"10 path=a\n").unwrap();
        assert_eq!(recs, vec![(b"path".to_vec(), b"a".to_vec())]);
    }
}
