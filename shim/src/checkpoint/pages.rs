//! Content-addressed page data for CRIU images.
//!
//! CRIU writes the memory of the dumped processes as raw 4 KiB pages to `pages-<id>.img`
//! (`pagemap-*.img` says which addresses they belong to and stays as it is). Successive dumps of
//! a sandbox repeat most of those pages, and there is no soft-dirty tracking on these hosts to
//! dump only the changed ones, so [`dedup`] cuts every pages file into 4 KiB chunks, stores each
//! chunk once under `chunks/<sha256 hex>` (shared by all images of the sandbox) and replaces the
//! pages file by a small *recipe*: its length and the digests of its chunks. [`materialize`]
//! rebuilds the pages files byte for byte (verifying every chunk) before a restore.
//!
//! 4 KiB is the page size, so a page that changed costs one chunk, wherever it is: an agent's
//! interpreter touches pages all over its heap. The recipe costs 32 bytes per page (0.8%).
//!
//! Durability: chunks and recipes are written to temp names and renamed, then one `syncfs` makes
//! the lot durable (one flush instead of an fsync per chunk). A chunk left by a crash before that
//! flush can be empty; a chunk is reused only when its size is right, and the store's sweep of
//! chunks no published image references ([`referenced_chunks`]) removes the rest.
//!
//! Recipe format (`pages-<id>.img.recipe`, little endian): magic `CRABPGS1`, u64 length of the
//! pages file, u32 chunk size, u32 zero, then one 32-byte sha256 digest per chunk (the last chunk
//! may be short).

use std::{
    collections::HashSet,
    fs::{self, File},
    io::{self, Read, Write},
    os::unix::{fs::MetadataExt, io::AsRawFd},
    path::{Path, PathBuf},
};

use sha2::{Digest, Sha256};

/// The unit of deduplication: one page.
pub const CHUNK_SIZE: usize = 4096;
const RECIPE_MAGIC: &[u8; 8] = b"CRABPGS1";
const RECIPE_SUFFIX: &str = ".recipe";
const HEADER_LEN: usize = 24;
/// Pages files are read in runs of this many bytes (a multiple of the chunk size).
const READ_BUF: usize = 1 << 20;

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
    #[error("chunk {hash} needed by {recipe} is missing or corrupt: {what}")]
    BadChunk { hash: String, recipe: PathBuf, what: String },
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
    /// Bytes of the new chunks.
    pub bytes_new: u64,
    /// Bytes of the recipes written.
    pub recipe_bytes: u64,
}

impl DedupStats {
    /// What this image added to the disk for its page data.
    pub fn bytes_stored(&self) -> u64 {
        self.bytes_new + self.recipe_bytes
    }
}

/// The pages files and the recipes of an image directory, by file name.
fn list(dir: &Path) -> Result<(Vec<String>, Vec<String>), PagesError> {
    let mut pages = Vec::new();
    let mut recipes = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err(format!("reading {}", dir.display())))? {
        let entry = entry.map_err(io_err(format!("reading {}", dir.display())))?;
        let Ok(name) = entry.file_name().into_string() else { continue };
        if !name.starts_with("pages-") {
            continue;
        }
        if name.ends_with(".img") {
            pages.push(name);
        } else if name.ends_with(RECIPE_SUFFIX) && name[..name.len() - RECIPE_SUFFIX.len()].ends_with(".img") {
            recipes.push(name);
        }
    }
    pages.sort();
    recipes.sort();
    Ok((pages, recipes))
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
fn write_atomic(dir: &Path, name: &str, data: &[&[u8]]) -> io::Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f = File::create(&tmp)?;
    for part in data {
        f.write_all(part)?;
    }
    drop(f);
    fs::rename(&tmp, dir.join(name))
}

fn syncfs(path: &Path) -> Result<(), PagesError> {
    let f = File::open(path).map_err(io_err(format!("opening {}", path.display())))?;
    // SAFETY: a plain syscall on a descriptor we own.
    if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
        return Err(io_err(format!("syncfs {}", path.display()))(io::Error::last_os_error()));
    }
    Ok(())
}

/// Makes the files of `dir` and the chunks durable: one `syncfs` per filesystem involved.
pub fn sync(dir: &Path, chunks: &Path) -> Result<(), PagesError> {
    syncfs(dir)?;
    let dev = |p: &Path| fs::metadata(p).map(|m| m.dev()).map_err(io_err(format!("stat {}", p.display())));
    if dev(dir)? != dev(chunks)? {
        syncfs(chunks)?;
    }
    Ok(())
}

/// Replaces every `pages-*.img` in `dir` by a recipe, storing its chunks in `chunks` (created if
/// missing). Idempotent: a pages file next to an existing recipe (after [`materialize`]) is
/// simply removed again once its chunks are known to be stored. Makes everything durable
/// before returning.
pub fn dedup(dir: &Path, chunks: &Path) -> Result<DedupStats, PagesError> {
    fs::create_dir_all(chunks).map_err(io_err(format!("creating {}", chunks.display())))?;
    let (pages, _) = list(dir)?;
    let mut stats = DedupStats::default();
    // Chunks known to be in the store during this call, so a page repeated within the image (or
    // shared by two processes) is looked up once.
    let mut present: HashSet<[u8; 32]> = HashSet::new();
    let mut buf = vec![0u8; READ_BUF];
    for name in pages {
        let path = dir.join(&name);
        let mut f = File::open(&path).map_err(io_err(format!("opening {}", path.display())))?;
        let mut digests: Vec<u8> = Vec::new();
        let mut len = 0u64;
        loop {
            let n = read_full(&mut f, &mut buf).map_err(io_err(format!("reading {}", path.display())))?;
            if n == 0 {
                break;
            }
            len += n as u64;
            for chunk in buf[..n].chunks(CHUNK_SIZE) {
                let digest: [u8; 32] = Sha256::digest(chunk).into();
                digests.extend_from_slice(&digest);
                stats.chunks += 1;
                if present.contains(&digest) {
                    continue;
                }
                let hash = hex(&digest);
                // A chunk of the wrong size is a leftover of a crash before the flush: rewrite it.
                let stored = matches!(fs::symlink_metadata(chunks.join(&hash)), Ok(m) if m.len() == chunk.len() as u64);
                if !stored {
                    write_atomic(chunks, &hash, &[chunk]).map_err(io_err(format!("storing chunk {hash}")))?;
                    stats.chunks_new += 1;
                    stats.bytes_new += chunk.len() as u64;
                }
                present.insert(digest);
            }
            if n < buf.len() {
                break;
            }
        }
        drop(f);
        let mut header = Vec::with_capacity(HEADER_LEN);
        header.extend_from_slice(RECIPE_MAGIC);
        header.extend_from_slice(&len.to_le_bytes());
        header.extend_from_slice(&(CHUNK_SIZE as u32).to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        let recipe = format!("{name}{RECIPE_SUFFIX}");
        write_atomic(dir, &recipe, &[&header, &digests]).map_err(io_err(format!("writing {}", dir.join(&recipe).display())))?;
        fs::remove_file(&path).map_err(io_err(format!("removing {}", path.display())))?;
        stats.files += 1;
        stats.bytes_logical += len;
        stats.recipe_bytes += (header.len() + digests.len()) as u64;
    }
    sync(dir, chunks)?;
    Ok(stats)
}

struct Recipe {
    len: u64,
    chunk_size: usize,
    digests: Vec<[u8; 32]>,
}

fn read_recipe(path: &Path) -> Result<Recipe, PagesError> {
    let data = fs::read(path).map_err(io_err(format!("reading {}", path.display())))?;
    let bad = |what: String| PagesError::BadRecipe { path: path.to_path_buf(), what };
    if data.len() < HEADER_LEN || &data[..8] != RECIPE_MAGIC {
        return Err(bad("no recipe header".into()));
    }
    let len = u64::from_le_bytes(data[8..16].try_into().unwrap());
    let chunk_size = u32::from_le_bytes(data[16..20].try_into().unwrap()) as usize;
    if chunk_size == 0 {
        return Err(bad("chunk size 0".into()));
    }
    let body = &data[HEADER_LEN..];
    let expected = len.div_ceil(chunk_size as u64);
    if body.len() % 32 != 0 || body.len() as u64 / 32 != expected {
        return Err(bad(format!("{} digest bytes for {len} bytes in chunks of {chunk_size}", body.len())));
    }
    let digests = body.chunks_exact(32).map(|d| d.try_into().unwrap()).collect();
    Ok(Recipe { len, chunk_size, digests })
}

/// Rebuilds every pages file of `dir` from its recipe (verifying each chunk's digest and size),
/// next to the recipe, so CRIU can restore from `dir`. Returns the bytes written.
pub fn materialize(dir: &Path, chunks: &Path) -> Result<u64, PagesError> {
    let (_, recipes) = list(dir)?;
    let mut total = 0u64;
    let mut chunk = Vec::with_capacity(CHUNK_SIZE);
    for name in recipes {
        let recipe_path = dir.join(&name);
        let recipe = read_recipe(&recipe_path)?;
        let target = &name[..name.len() - RECIPE_SUFFIX.len()];
        let tmp = dir.join(format!(".{target}.tmp"));
        let out = File::create(&tmp).map_err(io_err(format!("creating {}", tmp.display())))?;
        let mut out = io::BufWriter::with_capacity(READ_BUF, out);
        let mut remaining = recipe.len;
        for digest in &recipe.digests {
            let want = remaining.min(recipe.chunk_size as u64) as usize;
            let hash = hex(digest);
            let bad = |what: String| PagesError::BadChunk { hash: hash.clone(), recipe: recipe_path.clone(), what };
            chunk.clear();
            File::open(chunks.join(&hash))
                .and_then(|mut f| f.read_to_end(&mut chunk))
                .map_err(|e| bad(e.to_string()))?;
            if chunk.len() != want {
                return Err(bad(format!("{} bytes, expected {want}", chunk.len())));
            }
            if Sha256::digest(&chunk)[..] != digest[..] {
                return Err(bad("content does not match its digest".into()));
            }
            out.write_all(&chunk).map_err(io_err(format!("writing {}", tmp.display())))?;
            remaining -= want as u64;
        }
        out.into_inner()
            .map_err(|e| e.into_error())
            .and_then(|f| f.sync_all())
            .map_err(io_err(format!("writing {}", tmp.display())))?;
        fs::rename(&tmp, dir.join(target)).map_err(io_err(format!("renaming {}", tmp.display())))?;
        total += recipe.len;
    }
    Ok(total)
}

/// The chunks (hex digests) the recipes of an image directory refer to: what retention must
/// keep in `chunks/` while the image is kept.
pub fn referenced_chunks(dir: &Path) -> Result<HashSet<String>, PagesError> {
    let (_, recipes) = list(dir)?;
    let mut out = HashSet::new();
    for name in recipes {
        out.extend(read_recipe(&dir.join(name))?.digests.iter().map(|d| hex(d)));
    }
    Ok(out)
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
        let mut v: Vec<String> = fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        v.sort();
        v
    }

    #[test]
    fn round_trip_is_byte_identical_and_shares_chunks() {
        let tmp = tempfile::tempdir().unwrap();
        let (img1, img2, chunks) = (tmp.path().join("1"), tmp.path().join("2"), tmp.path().join("chunks"));
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
        assert_eq!(s1.bytes_logical, originals.iter().map(|(_, d)| d.len() as u64).sum::<u64>());
        // 200 distinct page contents (page(1) and page(2) among them) + the short tail chunk.
        assert_eq!(s1.chunks_new, 201);
        assert_eq!(s1.bytes_new, 200 * CHUNK_SIZE as u64 + 4);
        assert_eq!(
            files(&img1),
            ["pagemap-1.img", "pages-1.img.recipe", "pages-2.img.recipe", "pages-3.img.recipe", "pages-4.img.recipe"]
        );
        assert_eq!(referenced_chunks(&img1).unwrap().len(), 201);

        // A second image with one changed page stores one chunk.
        let mut changed = big.clone();
        changed[5 * CHUNK_SIZE + 9] ^= 0xff;
        fs::write(img2.join("pages-1.img"), &changed).unwrap();
        let s2 = dedup(&img2, &chunks).unwrap();
        assert_eq!((s2.chunks_new, s2.bytes_new), (1, CHUNK_SIZE as u64));

        assert_eq!(materialize(&img1, &chunks).unwrap(), s1.bytes_logical);
        for (name, data) in &originals {
            assert_eq!(&fs::read(img1.join(name)).unwrap(), data, "{name}");
        }
        assert_eq!(fs::read(img1.join("pagemap-1.img")).unwrap(), b"pagemap");
        materialize(&img2, &chunks).unwrap();
        assert_eq!(fs::read(img2.join("pages-1.img")).unwrap(), changed);
        // Dedup after materialize: nothing new, the pages files are gone again.
        let again = dedup(&img1, &chunks).unwrap();
        assert_eq!(again.chunks_new, 0);
        assert!(!img1.join("pages-1.img").exists());
        assert!(files(&chunks).iter().all(|n| !n.ends_with(".tmp")));
    }

    #[test]
    fn corrupt_or_missing_chunks_are_detected() {
        let tmp = tempfile::tempdir().unwrap();
        let (img, chunks) = (tmp.path().join("img"), tmp.path().join("chunks"));
        fs::create_dir_all(&img).unwrap();
        fs::write(img.join("pages-1.img"), [page(3), page(4)].concat()).unwrap();
        dedup(&img, &chunks).unwrap();
        let h3 = hex(&Sha256::digest(page(3)));
        let h4 = hex(&Sha256::digest(page(4)));
        fs::write(chunks.join(&h3), page(5)).unwrap();
        let e = materialize(&img, &chunks).unwrap_err();
        assert!(matches!(&e, PagesError::BadChunk { hash, .. } if *hash == h3), "{e}");
        fs::remove_file(chunks.join(&h4)).unwrap();
        fs::write(chunks.join(&h3), page(3)).unwrap();
        let e = materialize(&img, &chunks).unwrap_err();
        assert!(matches!(&e, PagesError::BadChunk { hash, .. } if *hash == h4), "{e}");
        assert!(!img.join("pages-1.img").exists(), "no partial pages file under the real name");
        // A truncated chunk (a crash before the flush) is rewritten by the next dedup.
        fs::write(chunks.join(&h4), b"").unwrap();
        fs::write(img.join("pages-1.img"), [page(3), page(4)].concat()).unwrap();
        let s = dedup(&img, &chunks).unwrap();
        assert_eq!(s.chunks_new, 1);
        materialize(&img, &chunks).unwrap();
        fs::write(img.join("pages-1.img.recipe"), b"CRABPGS1short").unwrap();
        assert!(matches!(materialize(&img, &chunks), Err(PagesError::BadRecipe { .. })));
    }
}
