//! Content-addressed page data for CRIU images.
//!
//! CRIU writes the memory of the dumped processes as raw 4 KiB pages to `pages-<id>.img`
//! (`pagemap-*.img` says which addresses they belong to and stays as it is). Successive dumps of
//! a sandbox repeat most of those pages, and there is no soft-dirty tracking on these hosts to
//! dump only the changed ones, so [`dedup`] cuts every pages file into 4 KiB chunks named by
//! their sha256, stores each chunk once in the sandbox's chunk store and replaces the pages file
//! by a small *recipe*: its length and the digests of its chunks. [`materialize`] rebuilds the
//! pages files byte for byte (verifying every chunk) before a restore.
//!
//! 4 KiB is the page size, so a changed page costs one chunk wherever it is: an agent's
//! interpreter touches pages all over its heap. The recipe costs 32 bytes per page (0.8%).
//!
//! The chunk store (`chunks/`) holds *packs*: the chunks one [`dedup`] call found new, appended
//! to `<name>.pack`, and `<name>.idx` listing (digest, offset, length) of each. One file per
//! chunk would cost a file creation per page (a 500 MB process: 128k files, seconds of
//! metadata work) where a pack is one sequential write. A pack is complete when its index
//! exists and the pack has the length the index says; anything else is a leftover of a crash
//! and is ignored (its chunks are stored again when needed) until [`collect_garbage`] removes
//! it. [`collect_garbage`] also drops packs no kept image refers to and rewrites packs that
//! are mostly dead. It must not run while a [`dedup`] of the same store runs (the coordinator
//! runs one job at a time per sandbox).
//!
//! Durability: everything is written to temp names and renamed, then one `syncfs` makes the
//! lot durable (one flush instead of an fsync per file of the image).
//!
//! Formats (little endian). Recipe `pages-<id>.img.recipe`: magic `CRABPGS1`, u64 length of the
//! pages file, u32 chunk size, u32 zero, then one 32-byte sha256 per chunk (the last chunk may
//! be short). Index `<name>.idx`: magic `CRABIDX1`, u64 pack length, u64 count, then per chunk
//! its 32-byte sha256, u64 offset and u32 length.

use std::{
    collections::{HashMap, HashSet},
    fs::{self, File},
    io::{self, BufWriter, Read, Write},
    os::unix::{
        fs::{FileExt, MetadataExt},
        io::AsRawFd,
    },
    path::{Path, PathBuf},
};

use sha2::{Digest, Sha256};

/// The unit of deduplication: one page.
pub const CHUNK_SIZE: usize = 4096;
const RECIPE_MAGIC: &[u8; 8] = b"CRABPGS1";
pub const RECIPE_SUFFIX: &str = ".recipe";
const RECIPE_HEADER: usize = 24;
const INDEX_MAGIC: &[u8; 8] = b"CRABIDX1";
const INDEX_HEADER: usize = 24;
const INDEX_ENTRY: usize = 44;
/// Pages files are read in runs of this many bytes (a multiple of the chunk size).
const READ_BUF: usize = 8 << 20;
/// Below this many bytes a run is hashed on the calling thread alone.
const PARALLEL_MIN: usize = 1 << 20;
/// At most this many threads hash one run.
const MAX_HASHERS: usize = 4;
/// A pack whose live chunks fill less than this fraction of it is rewritten by the collector.
const COMPACT_BELOW: f64 = 0.5;

pub type ChunkDigest = [u8; 32];
/// A chunk in a pack: digest, offset, length.
type IndexEntry = (ChunkDigest, u64, u32);

#[derive(Debug, thiserror::Error)]
pub enum PagesError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    #[error("bad page recipe {path}: {what}")]
    BadRecipe { path: PathBuf, what: String },
    #[error("chunk {hash} needed by {recipe} is missing or corrupt: {problem}")]
    BadChunk {
        hash: String,
        recipe: PathBuf,
        #[source]
        problem: ChunkProblem,
    },
}

/// What is wrong with one chunk of the chunk store.
#[derive(Debug, thiserror::Error)]
pub enum ChunkProblem {
    #[error("not in the chunk store")]
    NotStored,
    #[error("{}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Read(io::Error),
    #[error("content does not match its digest")]
    Digest,
    #[error("{got} bytes, expected {want}")]
    Length { got: usize, want: usize },
}

fn io_err(context: impl std::fmt::Display) -> impl FnOnce(io::Error) -> PagesError {
    let context = context.to_string();
    move |source| PagesError::Io { context, source }
}

/// What [`dedup`] did to one image directory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DedupStats {
    /// Pages files replaced by recipes.
    pub files: u64,
    /// Their total size: what the image would store without deduplication.
    pub bytes_logical: u64,
    pub chunks: u64,
    /// Chunks that were not in the chunk store yet (the rest were reused).
    pub chunks_new: u64,
    /// Bytes of the new chunks (the new pack).
    pub bytes_new: u64,
    /// Bytes of the new pack's index.
    pub index_bytes: u64,
    /// Bytes of the recipes written.
    pub recipe_bytes: u64,
}

impl DedupStats {
    /// What this image added to the disk for its page data.
    pub fn bytes_stored(&self) -> u64 {
        self.bytes_new + self.index_bytes + self.recipe_bytes
    }
}

/// What [`collect_garbage`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcStats {
    pub packs_removed: u64,
    pub packs_compacted: u64,
    /// Chunk bytes no longer stored (indexes not counted).
    pub bytes_freed: u64,
}

pub fn hex(digest: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(digest.len() * 2);
    for b in digest {
        s.push(HEX[(b >> 4) as usize] as char);
        s.push(HEX[(b & 15) as usize] as char);
    }
    s
}

/// The pages files and the recipes of an image directory, by file name.
fn list_image(dir: &Path) -> Result<(Vec<String>, Vec<String>), PagesError> {
    let mut pages = Vec::new();
    let mut recipes = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err(format!("reading {}", dir.display())))? {
        let entry = entry.map_err(io_err(format!("reading {}", dir.display())))?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        if !name.starts_with("pages-") {
            continue;
        }
        if name.ends_with(".img") {
            pages.push(name);
        } else if name
            .strip_suffix(RECIPE_SUFFIX)
            .is_some_and(|n| n.ends_with(".img"))
        {
            recipes.push(name);
        }
    }
    pages.sort();
    recipes.sort();
    Ok((pages, recipes))
}

/// The sha256 of each [`CHUNK_SIZE`] chunk of `data` (the last may be short), in order. A
/// large run is split between the host's CPUs (at most [`MAX_HASHERS`]): hashing is most of
/// a large image's deduplication.
fn chunk_digests(data: &[u8]) -> Vec<ChunkDigest> {
    let hash = |part: &[u8]| -> Vec<ChunkDigest> {
        part.chunks(CHUNK_SIZE)
            .map(|c| Sha256::digest(c).into())
            .collect()
    };
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_HASHERS);
    if data.len() < PARALLEL_MIN || threads < 2 {
        return hash(data);
    }
    // Parts of whole chunks, so that the digests line up.
    let per = data.len().div_ceil(CHUNK_SIZE).div_ceil(threads) * CHUNK_SIZE;
    std::thread::scope(|s| {
        let parts: Vec<_> = data
            .chunks(per)
            .map(|part| s.spawn(move || hash(part)))
            .collect();
        parts
            .into_iter()
            .flat_map(|h| h.join().expect("a hashing thread panicked"))
            .collect()
    })
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
fn read_full(f: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Writes `data` to `dir/.<name>.tmp` and renames it to `dir/<name>`; no fsync (see the module
/// docs: one `syncfs` covers everything).
fn write_atomic(dir: &Path, name: &str, data: &[&[u8]]) -> Result<(), PagesError> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let write = || {
        let mut f = BufWriter::new(File::create(&tmp)?);
        for part in data {
            f.write_all(part)?;
        }
        f.into_inner().map_err(|e| e.into_error())?;
        fs::rename(&tmp, dir.join(name))
    };
    write().map_err(|e| {
        // A full disk must not keep what it could not finish.
        let _ = fs::remove_file(&tmp);
        io_err(format!("writing {}", dir.join(name).display()))(e)
    })
}

/// A temp file removed when dropped unless [`TempPath::keep`] was called: what a failed write
/// (a full disk) leaves behind.
struct TempPath(Option<PathBuf>);

impl TempPath {
    fn path(&self) -> &Path {
        self.0.as_deref().expect("kept only once")
    }

    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_file(p);
        }
    }
}

fn syncfs(path: &Path) -> Result<(), PagesError> {
    let f = File::open(path).map_err(io_err(format!("opening {}", path.display())))?;
    // SAFETY: a plain syscall on a descriptor we own.
    if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
        return Err(io_err(format!("syncfs {}", path.display()))(
            io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Makes the files of `dir` and the chunk store durable: one `syncfs` per filesystem involved.
pub fn sync(dir: &Path, chunks: &Path) -> Result<(), PagesError> {
    syncfs(dir)?;
    let dev = |p: &Path| {
        fs::metadata(p)
            .map(|m| m.dev())
            .map_err(io_err(format!("stat {}", p.display())))
    };
    if dev(dir)? != dev(chunks)? {
        syncfs(chunks)?;
    }
    Ok(())
}

/// Where a chunk is: pack number (in [`ChunkStore::packs`]), offset, length.
#[derive(Debug, Clone, Copy)]
struct Loc {
    pack: usize,
    offset: u64,
    len: u32,
}

#[derive(Debug)]
struct Pack {
    name: String,
    len: u64,
    entries: Vec<IndexEntry>,
}

/// The complete packs of a chunk store and where each chunk is.
struct ChunkStore {
    dir: PathBuf,
    packs: Vec<Pack>,
    index: HashMap<ChunkDigest, Loc>,
    /// Files that are neither part of a complete pack nor a temp file being written: crash
    /// leftovers for the collector.
    leftovers: Vec<PathBuf>,
}

/// A parsed pack index: the pack's length and its (digest, offset, length) entries.
pub type PackIndex = (u64, Vec<(ChunkDigest, u64, u32)>);

/// Parses a pack index (`pack-*.idx`): the pack's length and its entries, each within the
/// pack; None if malformed. Public for the fuzz targets.
pub fn parse_index(data: &[u8]) -> Option<PackIndex> {
    if data.len() < INDEX_HEADER || &data[..8] != INDEX_MAGIC {
        return None;
    }
    let pack_len = u64::from_le_bytes(data[8..16].try_into().ok()?);
    let count = u64::from_le_bytes(data[16..24].try_into().ok()?);
    let body = &data[INDEX_HEADER..];
    if body.len() as u64 != count.checked_mul(INDEX_ENTRY as u64)? {
        return None;
    }
    let entries: Vec<_> = body
        .chunks_exact(INDEX_ENTRY)
        .map(|e| {
            (
                e[..32].try_into().unwrap(),
                u64::from_le_bytes(e[32..40].try_into().unwrap()),
                u32::from_le_bytes(e[40..44].try_into().unwrap()),
            )
        })
        .collect();
    entries
        .iter()
        .all(|(_, off, len)| {
            off.checked_add(u64::from(*len))
                .is_some_and(|end| end <= pack_len)
        })
        .then_some((pack_len, entries))
}

impl ChunkStore {
    fn open(dir: &Path) -> Result<ChunkStore, PagesError> {
        fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let mut names: Vec<String> = Vec::new();
        for entry in fs::read_dir(dir).map_err(io_err(format!("reading {}", dir.display())))? {
            let entry = entry.map_err(io_err(format!("reading {}", dir.display())))?;
            if let Ok(name) = entry.file_name().into_string() {
                names.push(name);
            }
        }
        names.sort();
        let mut store = ChunkStore {
            dir: dir.to_path_buf(),
            packs: Vec::new(),
            index: HashMap::new(),
            leftovers: Vec::new(),
        };
        let mut complete_packs = HashSet::new();
        for name in names.iter().filter_map(|n| n.strip_suffix(".idx")) {
            let idx = dir.join(format!("{name}.idx"));
            let pack = dir.join(format!("{name}.pack"));
            let data = fs::read(&idx).map_err(io_err(format!("reading {}", idx.display())))?;
            let parsed = parse_index(&data);
            let pack_len = fs::metadata(&pack).map(|m| m.len()).ok();
            match parsed {
                Some((len, entries)) if pack_len == Some(len) => {
                    let n = store.packs.len();
                    for (digest, offset, len) in &entries {
                        store.index.entry(*digest).or_insert(Loc {
                            pack: n,
                            offset: *offset,
                            len: *len,
                        });
                    }
                    store.packs.push(Pack {
                        name: name.to_string(),
                        len,
                        entries,
                    });
                    complete_packs.insert(name.to_string());
                }
                _ => {
                    log::warn!(
                        "chunk store {}: ignoring incomplete pack {name}",
                        dir.display()
                    );
                    store.leftovers.push(idx);
                }
            }
        }
        for name in &names {
            if let Some(stem) = name.strip_suffix(".pack") {
                if !complete_packs.contains(stem) {
                    store.leftovers.push(dir.join(name));
                }
            }
        }
        Ok(store)
    }

    fn new_pack(&self) -> Result<PackWriter, PagesError> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let name = format!("{nanos:024x}-{:x}", std::process::id());
        let tmp = self.dir.join(format!(".{name}.pack.tmp"));
        let file = File::create(&tmp).map_err(io_err(format!("creating {}", tmp.display())))?;
        Ok(PackWriter {
            name,
            tmp: TempPath(Some(tmp)),
            out: BufWriter::with_capacity(READ_BUF, file),
            len: 0,
            entries: Vec::new(),
        })
    }

    /// Reads a chunk, verifying its digest.
    fn read(
        &self,
        files: &mut HashMap<usize, File>,
        digest: &ChunkDigest,
    ) -> Result<Vec<u8>, ChunkProblem> {
        let loc = self.index.get(digest).ok_or(ChunkProblem::NotStored)?;
        let file = match files.entry(loc.pack) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let path = self.dir.join(format!("{}.pack", self.packs[loc.pack].name));
                e.insert(File::open(&path).map_err(|source| ChunkProblem::Open { path, source })?)
            }
        };
        let mut buf = vec![0u8; loc.len as usize];
        file.read_exact_at(&mut buf, loc.offset)
            .map_err(ChunkProblem::Read)?;
        if Sha256::digest(&buf)[..] != digest[..] {
            return Err(ChunkProblem::Digest);
        }
        Ok(buf)
    }
}

/// A pack being written: chunks appended to a temp file, published by [`PackWriter::finish`].
struct PackWriter {
    name: String,
    tmp: TempPath,
    out: BufWriter<File>,
    len: u64,
    entries: Vec<IndexEntry>,
}

impl PackWriter {
    fn add(&mut self, digest: ChunkDigest, data: &[u8]) -> Result<(), PagesError> {
        self.out
            .write_all(data)
            .map_err(io_err(format!("writing {}", self.tmp.path().display())))?;
        self.entries.push((digest, self.len, data.len() as u32));
        self.len += data.len() as u64;
        Ok(())
    }

    /// Renames the pack into place, then writes its index (which makes it complete). Returns
    /// the index's size, or `None` (and no files) when nothing was added.
    fn finish(self, dir: &Path) -> Result<Option<u64>, PagesError> {
        let PackWriter {
            name,
            tmp,
            out,
            len,
            entries,
        } = self;
        out.into_inner()
            .map_err(|e| io_err(format!("writing {}", tmp.path().display()))(e.into_error()))?;
        if entries.is_empty() {
            return Ok(None);
        }
        let pack = dir.join(format!("{name}.pack"));
        fs::rename(tmp.path(), &pack)
            .map_err(io_err(format!("renaming {}", tmp.path().display())))?;
        tmp.keep();
        let mut index = Vec::with_capacity(INDEX_HEADER + entries.len() * INDEX_ENTRY);
        index.extend_from_slice(INDEX_MAGIC);
        index.extend_from_slice(&len.to_le_bytes());
        index.extend_from_slice(&(entries.len() as u64).to_le_bytes());
        for (digest, offset, l) in &entries {
            index.extend_from_slice(digest);
            index.extend_from_slice(&offset.to_le_bytes());
            index.extend_from_slice(&l.to_le_bytes());
        }
        write_atomic(dir, &format!("{name}.idx"), &[&index])?;
        Ok(Some(index.len() as u64))
    }
}

/// Replaces every `pages-*.img` in `dir` by a recipe, adding the chunks the store does not
/// have yet as one new pack in `chunks` (created if missing). Idempotent: a pages file next
/// to an existing recipe (after [`materialize`]) is simply removed again. Makes everything
/// durable before returning.
pub fn dedup(dir: &Path, chunks: &Path) -> Result<DedupStats, PagesError> {
    let stats = dedup_unsynced(dir, chunks)?;
    sync(dir, chunks)?;
    Ok(stats)
}

/// [`dedup`] without making anything durable: the caller calls [`sync`] before it relies on
/// the recipes or the chunks.
pub fn dedup_unsynced(dir: &Path, chunks: &Path) -> Result<DedupStats, PagesError> {
    let store = ChunkStore::open(chunks)?;
    let (pages, _) = list_image(dir)?;
    let mut stats = DedupStats::default();
    let mut pack = store.new_pack()?;
    let mut added: HashSet<ChunkDigest> = HashSet::new();
    let mut buf = vec![0u8; READ_BUF];
    let mut recipes: Vec<(String, Vec<u8>)> = Vec::new();
    for name in &pages {
        let path = dir.join(name);
        let mut f = File::open(&path).map_err(io_err(format!("opening {}", path.display())))?;
        let mut digests: Vec<u8> = Vec::new();
        let mut len = 0u64;
        loop {
            let n = read_full(&mut f, &mut buf)
                .map_err(io_err(format!("reading {}", path.display())))?;
            len += n as u64;
            let hashed = chunk_digests(&buf[..n]);
            for (chunk, digest) in buf[..n].chunks(CHUNK_SIZE).zip(hashed) {
                digests.extend_from_slice(&digest);
                stats.chunks += 1;
                if !store.index.contains_key(&digest) && added.insert(digest) {
                    pack.add(digest, chunk)?;
                    stats.chunks_new += 1;
                    stats.bytes_new += chunk.len() as u64;
                }
            }
            if n < buf.len() {
                break;
            }
        }
        let mut recipe = Vec::with_capacity(RECIPE_HEADER + digests.len());
        recipe.extend_from_slice(RECIPE_MAGIC);
        recipe.extend_from_slice(&len.to_le_bytes());
        recipe.extend_from_slice(&(CHUNK_SIZE as u32).to_le_bytes());
        recipe.extend_from_slice(&0u32.to_le_bytes());
        recipe.extend_from_slice(&digests);
        stats.files += 1;
        stats.bytes_logical += len;
        recipes.push((name.clone(), recipe));
    }
    // The pack is in place before any recipe names its chunks.
    stats.index_bytes = pack.finish(chunks)?.unwrap_or(0);
    for (name, recipe) in recipes {
        write_atomic(dir, &format!("{name}{RECIPE_SUFFIX}"), &[&recipe])?;
        let path = dir.join(&name);
        fs::remove_file(&path).map_err(io_err(format!("removing {}", path.display())))?;
        stats.recipe_bytes += recipe.len() as u64;
    }
    Ok(stats)
}

/// A pages file as chunk digests (its `.recipe` file).
#[derive(Debug)]
pub struct Recipe {
    pub len: u64,
    pub chunk_size: usize,
    pub digests: Vec<ChunkDigest>,
}

fn read_recipe(path: &Path) -> Result<Recipe, PagesError> {
    let data = fs::read(path).map_err(io_err(format!("reading {}", path.display())))?;
    parse_recipe(path, &data)
}

/// Parses the recipe `data` read from `path` (named in errors). Public for the fuzz targets.
pub fn parse_recipe(path: &Path, data: &[u8]) -> Result<Recipe, PagesError> {
    let bad = |what: String| PagesError::BadRecipe {
        path: path.to_path_buf(),
        what,
    };
    if data.len() < RECIPE_HEADER || &data[..8] != RECIPE_MAGIC {
        return Err(bad("no recipe header".into()));
    }
    let len = u64::from_le_bytes(data[8..16].try_into().unwrap());
    let chunk_size = u32::from_le_bytes(data[16..20].try_into().unwrap()) as usize;
    if chunk_size == 0 {
        return Err(bad("chunk size 0".into()));
    }
    let body = &data[RECIPE_HEADER..];
    let expected = len.div_ceil(chunk_size as u64);
    if !body.len().is_multiple_of(32) || body.len() as u64 / 32 != expected {
        return Err(bad(format!(
            "{} digest bytes for {len} bytes in chunks of {chunk_size}",
            body.len()
        )));
    }
    let digests = body
        .chunks_exact(32)
        .map(|d| d.try_into().unwrap())
        .collect();
    Ok(Recipe {
        len,
        chunk_size,
        digests,
    })
}

/// Rebuilds every pages file of `dir` from its recipe (verifying each chunk's digest and size),
/// next to the recipe, so CRIU can restore from `dir`. Returns the bytes written.
pub fn materialize(dir: &Path, chunks: &Path) -> Result<u64, PagesError> {
    let store = ChunkStore::open(chunks)?;
    let (_, recipes) = list_image(dir)?;
    let mut files = HashMap::new();
    let mut total = 0u64;
    for name in recipes {
        let recipe_path = dir.join(&name);
        let recipe = read_recipe(&recipe_path)?;
        let target = &name[..name.len() - RECIPE_SUFFIX.len()];
        let tmp = dir.join(format!(".{target}.tmp"));
        let out = File::create(&tmp).map_err(io_err(format!("creating {}", tmp.display())))?;
        let mut out = BufWriter::with_capacity(READ_BUF, out);
        let mut remaining = recipe.len;
        for digest in &recipe.digests {
            let want = remaining.min(recipe.chunk_size as u64) as usize;
            let bad = |problem: ChunkProblem| PagesError::BadChunk {
                hash: hex(digest),
                recipe: recipe_path.clone(),
                problem,
            };
            let chunk = store.read(&mut files, digest).map_err(bad)?;
            if chunk.len() != want {
                return Err(bad(ChunkProblem::Length {
                    got: chunk.len(),
                    want,
                }));
            }
            out.write_all(&chunk)
                .map_err(io_err(format!("writing {}", tmp.display())))?;
            remaining -= want as u64;
        }
        out.into_inner()
            .map_err(|e| e.into_error())
            .and_then(|f| f.sync_all())
            .map_err(io_err(format!("writing {}", tmp.display())))?;
        fs::rename(&tmp, dir.join(target))
            .map_err(io_err(format!("renaming {}", tmp.display())))?;
        total += recipe.len;
    }
    Ok(total)
}

/// The chunks the recipes of an image directory refer to.
pub fn referenced_chunks(dir: &Path) -> Result<HashSet<ChunkDigest>, PagesError> {
    let (_, recipes) = list_image(dir)?;
    let mut out = HashSet::new();
    for name in recipes {
        out.extend(read_recipe(&dir.join(name))?.digests);
    }
    Ok(out)
}

/// Frees what the kept images (`keep`: their directories) no longer need: packs none of whose
/// chunks they refer to, and crash leftovers, are removed; packs whose live chunks fill less than
/// half of them are rewritten with only those chunks. Must not overlap a [`dedup`] into the same
/// `chunks`; makes its changes durable before returning.
pub fn collect_garbage(chunks: &Path, keep: &[PathBuf]) -> Result<GcStats, PagesError> {
    let store = ChunkStore::open(chunks)?;
    let mut live = HashSet::new();
    for dir in keep {
        live.extend(referenced_chunks(dir)?);
    }
    let mut stats = GcStats::default();
    let remove = |path: &Path| match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(io_err(format!("removing {}", path.display()))(e))
        }
        _ => Ok(()),
    };
    for path in &store.leftovers {
        stats.bytes_freed += fs::metadata(path).map(|m| m.len()).unwrap_or(0);
        remove(path)?;
    }
    let mut files = HashMap::new();
    for (n, pack) in store.packs.iter().enumerate() {
        // Chunks this pack holds for the kept images (another pack may hold the same chunk: the
        // index names the first, and only that one counts as live).
        let live_here: Vec<&IndexEntry> = pack
            .entries
            .iter()
            .filter(|(d, _, _)| live.contains(d) && store.index.get(d).is_some_and(|l| l.pack == n))
            .collect();
        let live_bytes: u64 = live_here.iter().map(|(_, _, l)| u64::from(*l)).sum();
        if !live_here.is_empty() && live_bytes as f64 >= COMPACT_BELOW * pack.len as f64 {
            continue;
        }
        if !live_here.is_empty() {
            let mut writer = store.new_pack()?;
            for (digest, _, _) in &live_here {
                let data =
                    store
                        .read(&mut files, digest)
                        .map_err(|problem| PagesError::BadChunk {
                            hash: hex(digest),
                            recipe: chunks.join(format!("{}.pack", pack.name)),
                            problem,
                        })?;
                writer.add(*digest, &data)?;
            }
            writer.finish(chunks)?;
            // The copy must be durable before the original goes.
            syncfs(chunks)?;
            stats.packs_compacted += 1;
        } else {
            stats.packs_removed += 1;
        }
        stats.bytes_freed += pack.len - live_bytes;
        files.remove(&n);
        // The index first: a pack without its index is a leftover, never a half-valid pack.
        remove(&chunks.join(format!("{}.idx", pack.name)))?;
        remove(&chunks.join(format!("{}.pack", pack.name)))?;
    }
    syncfs(chunks)?;
    Ok(stats)
}

/// A pages file rebuilt from its recipe as it is read, for copying an image elsewhere (a
/// checkpoint image) while the store keeps only the recipe. Every chunk's digest and size are
/// verified; a bad chunk is a read error carrying [`PagesError::BadChunk`].
pub struct PagesReader {
    name: String,
    recipe_path: PathBuf,
    recipe: Recipe,
    store: std::sync::Arc<ChunkStore>,
    files: HashMap<usize, File>,
    next: usize,
    remaining: u64,
    chunk: Vec<u8>,
    pos: usize,
}

impl PagesReader {
    /// The pages file's name (`pages-<id>.img`), as CRIU expects it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.recipe.len
    }

    pub fn is_empty(&self) -> bool {
        self.recipe.len == 0
    }

    fn next_chunk(&mut self) -> Result<bool, PagesError> {
        let Some(digest) = self.recipe.digests.get(self.next) else {
            return Ok(false);
        };
        let want = self.remaining.min(self.recipe.chunk_size as u64) as usize;
        let bad = |problem: ChunkProblem| PagesError::BadChunk {
            hash: hex(digest),
            recipe: self.recipe_path.clone(),
            problem,
        };
        let chunk = self.store.read(&mut self.files, digest).map_err(bad)?;
        if chunk.len() != want {
            return Err(bad(ChunkProblem::Length {
                got: chunk.len(),
                want,
            }));
        }
        self.next += 1;
        self.remaining -= want as u64;
        self.chunk = chunk;
        self.pos = 0;
        Ok(true)
    }
}

impl Read for PagesReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.pos == self.chunk.len() {
            if !self.next_chunk().map_err(io::Error::other)? {
                return Ok(0);
            }
        }
        let n = buf.len().min(self.chunk.len() - self.pos);
        buf[..n].copy_from_slice(&self.chunk[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// A reader for every pages file the recipes of `dir` stand for, sorted by name; `dir` and
/// `chunks` are not changed (unlike [`materialize`], which writes the files next to the
/// recipes).
pub fn materialized_readers(dir: &Path, chunks: &Path) -> Result<Vec<PagesReader>, PagesError> {
    let store = std::sync::Arc::new(ChunkStore::open(chunks)?);
    let (_, recipes) = list_image(dir)?;
    recipes
        .into_iter()
        .map(|name| {
            let recipe_path = dir.join(&name);
            let recipe = read_recipe(&recipe_path)?;
            Ok(PagesReader {
                name: name[..name.len() - RECIPE_SUFFIX.len()].to_string(),
                remaining: recipe.len,
                recipe_path,
                recipe,
                store: store.clone(),
                files: HashMap::new(),
                next: 0,
                chunk: Vec::new(),
                pos: 0,
            })
        })
        .collect()
}

/// Whether `name` is a pages recipe (what [`materialized_readers`] stands in for).
pub fn is_recipe(name: &str) -> bool {
    name.starts_with("pages-")
        && name
            .strip_suffix(RECIPE_SUFFIX)
            .is_some_and(|n| n.ends_with(".img"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(fill: u8) -> Vec<u8> {
        let mut p = vec![fill; CHUNK_SIZE];
        p[0] = fill.wrapping_mul(7);
        p
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    fn digest(data: &[u8]) -> ChunkDigest {
        Sha256::digest(data).into()
    }

    fn packs(chunks: &Path) -> Vec<String> {
        files(chunks)
            .into_iter()
            .filter(|n| n.ends_with(".pack"))
            .collect()
    }

    #[test]
    fn round_trip_is_byte_identical_and_shares_chunks() {
        let tmp = tempfile::tempdir().unwrap();
        let (img1, img2, chunks) = (
            tmp.path().join("1"),
            tmp.path().join("2"),
            tmp.path().join("chunks"),
        );
        fs::create_dir_all(&img1).unwrap();
        fs::create_dir_all(&img2).unwrap();
        // Pages repeated within a file and across files, a file larger than one read buffer, a
        // short tail, an empty file, and a non-pages file that must stay untouched.
        let mut big = Vec::new();
        for i in 0..(READ_BUF / CHUNK_SIZE + 3) {
            big.extend(page((i % 200) as u8));
        }
        let mut odd = page(1);
        odd.extend_from_slice(b"tail");
        let originals: Vec<(&str, Vec<u8>)> = vec![
            ("pages-1.img", [page(1), page(2), page(1)].concat()),
            ("pages-2.img", big.clone()),
            ("pages-3.img", odd),
            ("pages-4.img", Vec::new()),
        ];
        for (name, data) in &originals {
            fs::write(img1.join(name), data).unwrap();
        }
        fs::write(img1.join("pagemap-1.img"), b"pagemap").unwrap();
        let s1 = dedup(&img1, &chunks).unwrap();
        assert_eq!(s1.files, 4);
        assert_eq!(
            s1.bytes_logical,
            originals.iter().map(|(_, d)| d.len() as u64).sum::<u64>()
        );
        // 200 distinct page contents (page(1) and page(2) among them) + the short tail chunk.
        assert_eq!(s1.chunks_new, 201);
        assert_eq!(s1.bytes_new, 200 * CHUNK_SIZE as u64 + 4);
        assert_eq!(
            files(&img1),
            [
                "pagemap-1.img",
                "pages-1.img.recipe",
                "pages-2.img.recipe",
                "pages-3.img.recipe",
                "pages-4.img.recipe"
            ]
        );
        assert_eq!(referenced_chunks(&img1).unwrap().len(), 201);
        assert_eq!(packs(&chunks).len(), 1);

        // A second image with one changed page stores one chunk.
        let mut changed = big.clone();
        changed[5 * CHUNK_SIZE + 9] ^= 0xff;
        fs::write(img2.join("pages-1.img"), &changed).unwrap();
        let s2 = dedup(&img2, &chunks).unwrap();
        assert_eq!((s2.chunks_new, s2.bytes_new), (1, CHUNK_SIZE as u64));
        assert_eq!(packs(&chunks).len(), 2);

        assert_eq!(materialize(&img1, &chunks).unwrap(), s1.bytes_logical);
        for (name, data) in &originals {
            assert_eq!(&fs::read(img1.join(name)).unwrap(), data, "{name}");
        }
        assert_eq!(fs::read(img1.join("pagemap-1.img")).unwrap(), b"pagemap");
        materialize(&img2, &chunks).unwrap();
        assert_eq!(fs::read(img2.join("pages-1.img")).unwrap(), changed);
        // Dedup after materialize: nothing new (and no empty pack), the pages files are gone again.
        let again = dedup(&img1, &chunks).unwrap();
        assert_eq!(again.chunks_new, 0);
        assert_eq!(packs(&chunks).len(), 2);
        assert!(!img1.join("pages-1.img").exists());
        assert!(files(&chunks).iter().all(|n| !n.ends_with(".tmp")));
    }

    #[test]
    fn parallel_digests_match_serial_ones() {
        // Sizes around the thresholds and a short last chunk.
        for len in [
            0,
            1,
            CHUNK_SIZE,
            PARALLEL_MIN - 1,
            PARALLEL_MIN,
            PARALLEL_MIN + 5,
            3 * PARALLEL_MIN + CHUNK_SIZE / 2,
        ] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
            let serial: Vec<ChunkDigest> = data
                .chunks(CHUNK_SIZE)
                .map(|c| Sha256::digest(c).into())
                .collect();
            assert_eq!(chunk_digests(&data), serial, "{len} bytes");
        }
    }

    #[test]
    fn corrupt_missing_and_incomplete_chunks() {
        let tmp = tempfile::tempdir().unwrap();
        let (img, chunks) = (tmp.path().join("img"), tmp.path().join("chunks"));
        fs::create_dir_all(&img).unwrap();
        fs::write(img.join("pages-1.img"), [page(3), page(4)].concat()).unwrap();
        dedup(&img, &chunks).unwrap();
        let pack = chunks.join(&packs(&chunks)[0]);
        let good = fs::read(&pack).unwrap();
        // A flipped bit is caught by the digest check.
        let mut bad = good.clone();
        bad[CHUNK_SIZE + 1] ^= 1;
        fs::write(&pack, &bad).unwrap();
        let e = materialize(&img, &chunks).unwrap_err();
        assert!(
            matches!(&e, PagesError::BadChunk { hash, .. } if *hash == hex(&digest(&page(4)))),
            "{e}"
        );
        assert!(
            !img.join("pages-1.img").exists(),
            "no partial pages file under the real name"
        );
        // A pack shorter than its index says (a crash before the flush) is ignored: its chunks
        // are missing, and the next dedup stores them again.
        fs::write(&pack, &good[..CHUNK_SIZE]).unwrap();
        let e = materialize(&img, &chunks).unwrap_err();
        assert!(
            matches!(
                &e,
                PagesError::BadChunk {
                    problem: ChunkProblem::NotStored,
                    ..
                }
            ),
            "{e}"
        );
        fs::write(img.join("pages-1.img"), [page(3), page(4)].concat()).unwrap();
        assert_eq!(dedup(&img, &chunks).unwrap().chunks_new, 2);
        materialize(&img, &chunks).unwrap();
        assert_eq!(
            fs::read(img.join("pages-1.img")).unwrap(),
            [page(3), page(4)].concat()
        );
        // The collector removes the broken pack; the good one stays.
        let gc = collect_garbage(&chunks, std::slice::from_ref(&img)).unwrap();
        assert_eq!((gc.packs_removed, gc.packs_compacted), (0, 0));
        assert_eq!(packs(&chunks).len(), 1);
        assert!(!pack.exists());
        materialize(&img, &chunks).unwrap();
        fs::write(img.join("pages-1.img.recipe"), b"CRABPGS1short").unwrap();
        assert!(matches!(
            materialize(&img, &chunks),
            Err(PagesError::BadRecipe { .. })
        ));
    }

    #[test]
    fn garbage_collection_removes_dead_packs_and_compacts_sparse_ones() {
        let tmp = tempfile::tempdir().unwrap();
        let chunks = tmp.path().join("chunks");
        let image = |name: &str, pages: &[u8]| {
            let dir = tmp.path().join(name);
            fs::create_dir_all(&dir).unwrap();
            fs::write(
                dir.join("pages-1.img"),
                pages.iter().flat_map(|p| page(*p)).collect::<Vec<u8>>(),
            )
            .unwrap();
            dedup(&dir, &chunks).unwrap();
            dir
        };
        // a: pages 0..10 (pack A); b: 0..2 + 10..20 (pack B holds 10..20); c: 30 (pack C).
        let a = image("a", &(0..10).collect::<Vec<_>>());
        let b = image("b", &[0, 1].into_iter().chain(10..20).collect::<Vec<_>>());
        let c = image("c", &[30]);
        assert_eq!(packs(&chunks).len(), 3);
        // Keeping b alone: A is 20% live (pages 0, 1) -> compacted; B fully live; C dead.
        let gc = collect_garbage(&chunks, std::slice::from_ref(&b)).unwrap();
        assert_eq!((gc.packs_removed, gc.packs_compacted), (1, 1));
        assert_eq!(gc.bytes_freed, 9 * CHUNK_SIZE as u64);
        assert_eq!(packs(&chunks).len(), 2);
        materialize(&b, &chunks).unwrap();
        assert_eq!(
            fs::read(b.join("pages-1.img")).unwrap(),
            [0u8, 1]
                .into_iter()
                .chain(10..20)
                .flat_map(page)
                .collect::<Vec<u8>>()
        );
        assert!(materialize(&a, &chunks).is_err());
        assert!(materialize(&c, &chunks).is_err());
        // Nothing kept: nothing stays.
        collect_garbage(&chunks, &[]).unwrap();
        assert!(files(&chunks).is_empty(), "{:?}", files(&chunks));
    }

    #[test]
    fn readers_rebuild_pages_elsewhere_and_leave_the_image_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let (img, chunks) = (tmp.path().join("img"), tmp.path().join("chunks"));
        fs::create_dir_all(&img).unwrap();
        let mut odd = [page(5), page(6), page(5)].concat();
        odd.extend_from_slice(b"tail");
        fs::write(img.join("pages-1.img"), &odd).unwrap();
        fs::write(img.join("pages-2.img"), b"").unwrap();
        fs::write(img.join("pagemap-1.img"), b"pagemap").unwrap();
        dedup(&img, &chunks).unwrap();
        let before = files(&img);
        let mut readers = materialized_readers(&img, &chunks).unwrap();
        assert_eq!(
            readers
                .iter()
                .map(|r| (r.name().to_string(), r.len()))
                .collect::<Vec<_>>(),
            [
                ("pages-1.img".to_string(), odd.len() as u64),
                ("pages-2.img".to_string(), 0)
            ]
        );
        let mut out = Vec::new();
        readers[0].read_to_end(&mut out).unwrap();
        assert_eq!(out, odd);
        out.clear();
        readers[1].read_to_end(&mut out).unwrap();
        assert!(out.is_empty());
        assert_eq!(files(&img), before, "the image keeps its recipes only");
        assert!(is_recipe("pages-1.img.recipe") && !is_recipe("pagemap-1.img"));
        // A corrupt chunk is a read error naming it.
        let pack = chunks.join(&packs(&chunks)[0]);
        let mut data = fs::read(&pack).unwrap();
        data[CHUNK_SIZE + 3] ^= 1;
        fs::write(&pack, &data).unwrap();
        let mut r = materialized_readers(&img, &chunks).unwrap().remove(0);
        let e = r.read_to_end(&mut Vec::new()).unwrap_err();
        assert!(e.to_string().contains(&hex(&digest(&page(6)))), "{e}");
    }
}
