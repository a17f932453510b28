//! A checkpoint as an OCI image (RESTORE.md "Checkpoint image"), as pure data: the base image's
//! layers and config with crab's additions stripped, the manifest and config of the new image,
//! and the checkpoint layer carrying the reserved directory. Nothing here talks to containerd.
//!
//! Everything is deterministic: the same checkpoint exported twice gives the same digests
//! (timestamps come from the checkpoint's manifest, tar entries carry no wall-clock time), so a
//! second export of a checkpoint (a rollback to a turn exported before) finds every blob in
//! the content store already.

use std::{
    collections::{BTreeMap, HashMap},
    fs,
    io::{self, Read, Write},
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
};

use ed25519_dalek::SigningKey;
use oci_spec::image::{
    self as oci, ConfigBuilder, HistoryBuilder, ImageConfigurationBuilder, ImageManifestBuilder,
    MediaType, RootFsBuilder,
};
use serde::Serialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crab_shim::checkpoint::{
    pages::{self, PagesError},
    provenance::{self, FileDigest, HashingReader, Statement, SIGNATURE_FILE},
    store::{digest_string, Descriptor},
};
use crab_shim::restore::intake::{CheckpointMeta, CRIU_DIR, META_FILE, RESERVED_DIR};

/// The OCI marker that makes its directory opaque: lower layers' entries under it are hidden.
const OPAQUE_WHITEOUT: &str = ".wh..wh..opq";

/// Docker's media types (the OCI ones are oci-spec's [`MediaType`]).
pub const MEDIA_TYPE_DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const MEDIA_TYPE_DOCKER_LIST: &str =
    "application/vnd.docker.distribution.manifest.list.v2+json";
/// The checkpoint layer's media type (the store's layers use the same).
pub use crab_shim::checkpoint::store::MEDIA_TYPE_LAYER_ZSTD;

/// Config label: how many of the image's layers are its base image's (the rest are crab's).
pub const LABEL_BASE_LAYERS: &str = "io.crab.checkpoint.base-layers";
/// Config label: `<namespace>/<container>@<seq>` the image was exported from.
pub const LABEL_SOURCE: &str = "io.crab.checkpoint.source";
/// Image label: what the image was built from, exactly (the store's checkpoint record and the
/// signing key's public half, hashed): an internal image with the same identity is not built
/// again (see `Ctl::export_leased`).
pub const LABEL_IDENTITY: &str = "io.crab.checkpoint.identity";

/// zstd level of the checkpoint layer (as the store's layers).
const ZSTD_LEVEL: i32 = 3;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("base image {what}: {reason}")]
    BadBase { what: &'static str, reason: String },
    #[error("checkpoint layer: {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("checkpoint layer: {path} is {found}: a CRIU image holds plain files only")]
    NotPlain { path: PathBuf, found: &'static str },
    #[error("checkpoint layer: process image: {0}")]
    Pages(#[from] PagesError),
    #[error("layer {digest:?}: not an OCI descriptor: {reason}")]
    Descriptor { digest: String, reason: String },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> ImageError + '_ {
    move |source| ImageError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// An OCI content descriptor of `size` bytes of `media_type` (a [`MediaType`] or its name)
/// whose digest is `digest`: an error if that is no digest (oci-spec checks its form).
pub fn descriptor(
    media_type: impl Into<MediaType>,
    digest: &str,
    size: u64,
) -> Result<oci::Descriptor, ImageError> {
    let parsed = digest.parse::<oci::Digest>();
    let digest = parsed.map_err(|e| ImageError::Descriptor {
        digest: digest.to_string(),
        reason: e.to_string(),
    })?;
    Ok(oci::Descriptor::new(media_type.into(), size, digest))
}

/// The descriptor of `blob` (its digest computed here) as `media_type`.
pub fn descriptor_of(media_type: MediaType, blob: &[u8]) -> oci::Descriptor {
    descriptor(media_type, &sha256_of(blob), blob.len() as u64)
        .expect("a sha256 digest computed here is one")
}

/// `value` as JSON with its object keys sorted (serde_json's maps are ordered by key), the form
/// crab's manifests have always had: the same image gives the same bytes, hence digests, as
/// before oci-spec's types built them (whose fields serialize in declaration order).
pub fn sorted_json(value: &impl Serialize) -> Vec<u8> {
    let value = serde_json::to_value(value).expect("an OCI document serializes");
    serde_json::to_vec(&value).expect("a JSON value serializes")
}

/// What a checkpoint image starts from: the base image's layers (with their diff ids) and
/// its config, without anything crab added when the image is itself a checkpoint image.
#[derive(Debug, Clone, PartialEq)]
pub struct Base {
    pub layers: Vec<oci::Descriptor>,
    pub diff_ids: Vec<String>,
    /// Kept as JSON, not oci-spec's `ImageConfiguration`: a base image's config carries
    /// Docker's fields (`Healthcheck`, `OnBuild`, `Shell`, ...) the OCI type does not know, and
    /// the checkpoint image keeps them.
    pub config: Value,
}

fn bad(what: &'static str) -> impl Fn(String) -> ImageError {
    move |reason| ImageError::BadBase { what, reason }
}

/// The image config's labels (`config.Labels`), if any.
pub fn config_labels(config: &Value) -> BTreeMap<String, String> {
    config["config"]["Labels"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// The base of a new checkpoint image from an image's manifest and config. A checkpoint image
/// (label [`LABEL_BASE_LAYERS`]) contributes only its first base-layers layers, and its config
/// loses the diff ids, history entries and labels crab added, so checkpoint images never nest.
pub fn base_of(manifest: &Value, config: &Value) -> Result<Base, ImageError> {
    let layers: Vec<oci::Descriptor> = serde_json::from_value(manifest["layers"].clone())
        .map_err(|e| bad("manifest")(format!("layers: {e}")))?;
    let diff_ids: Vec<String> = serde_json::from_value(config["rootfs"]["diff_ids"].clone())
        .map_err(|e| bad("config")(format!("rootfs.diff_ids: {e}")))?;
    if layers.len() != diff_ids.len() {
        return Err(bad("config")(format!(
            "{} layers in the manifest but {} diff ids",
            layers.len(),
            diff_ids.len()
        )));
    }
    let keep = match config_labels(config).get(LABEL_BASE_LAYERS) {
        None => layers.len(),
        Some(n) => n
            .parse::<usize>()
            .ok()
            .filter(|n| *n <= layers.len())
            .ok_or_else(|| {
                bad("config")(format!(
                    "label {LABEL_BASE_LAYERS}={n:?} for an image of {} layers",
                    layers.len()
                ))
            })?,
    };
    let mut config = config.clone();
    config["rootfs"]["diff_ids"] = json!(diff_ids[..keep]);
    if let Some(history) = config["history"].as_array() {
        config["history"] = Value::Array(history_for_layers(history, keep));
    }
    if let Some(process) = config["config"].as_object_mut() {
        if let Some(labels) = process.get_mut("Labels").and_then(Value::as_object_mut) {
            labels.remove(LABEL_BASE_LAYERS);
            labels.remove(LABEL_SOURCE);
            if labels.is_empty() {
                process.remove("Labels");
            }
        }
    }
    Ok(Base {
        layers: layers[..keep].to_vec(),
        diff_ids: diff_ids[..keep].to_vec(),
        config,
    })
}

/// The history entries that describe the first `layers` layers: up to the one of the last
/// kept layer, with the empty-layer entries (config changes) that follow it.
fn history_for_layers(history: &[Value], layers: usize) -> Vec<Value> {
    let mut seen = 0;
    history
        .iter()
        .take_while(|h| {
            let empty = h["empty_layer"].as_bool().unwrap_or(false);
            if !empty {
                seen += 1;
            }
            empty || seen <= layers
        })
        .cloned()
        .collect()
}

/// A layer blob: digest and size as stored, digest of its uncompressed tar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerBlob {
    pub digest: String,
    pub diff_id: String,
    pub size: u64,
}

/// What the new image says about where it came from.
#[derive(Debug, Clone)]
pub struct Provenance<'a> {
    /// `<namespace>/<container>@<seq>`.
    pub source: &'a str,
    pub turn_id: &'a str,
    /// RFC 3339; the checkpoint's own time, so exports are reproducible.
    pub created: &'a str,
}

/// A checkpoint image: its manifest and config blobs and the layers they name (oldest first).
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointImage {
    pub manifest: Vec<u8>,
    pub config: Vec<u8>,
    pub layers: Vec<oci::Descriptor>,
    pub diff_ids: Vec<String>,
    pub base_layers: usize,
}

impl CheckpointImage {
    pub fn manifest_digest(&self) -> String {
        sha256_of(&self.manifest)
    }

    pub fn config_digest(&self) -> String {
        sha256_of(&self.config)
    }

    /// The content labels of the manifest that keep its config and layers from containerd's
    /// garbage collector while the manifest is referenced.
    pub fn manifest_gc_labels(&self) -> HashMap<String, String> {
        let mut labels = HashMap::from([(
            "containerd.io/gc.ref.content.config".to_string(),
            self.config_digest(),
        )]);
        for (i, l) in self.layers.iter().enumerate() {
            labels.insert(
                format!("containerd.io/gc.ref.content.l.{i}"),
                l.digest().to_string(),
            );
        }
        labels
    }

    /// The chain id of every layer prefix: the names of the committed snapshots.
    pub fn chain_ids(&self) -> Vec<String> {
        chain_ids(&self.diff_ids)
    }
}

/// Builds the image: base layers + the checkpoint's fs layers + the checkpoint layer; the
/// base config with extended `rootfs.diff_ids`, appended history and crab's labels (its
/// Entrypoint, Cmd, Env, WorkingDir and User stay as they are).
pub fn build(
    base: &Base,
    fs_layers: &[Descriptor],
    checkpoint_layer: &LayerBlob,
    from: &Provenance<'_>,
) -> Result<CheckpointImage, ImageError> {
    assemble(base, fs_layers, Some(checkpoint_layer), from)
}

/// A plain image of a checkpoint's files: base layers + the fs layers, the base config with
/// extended `rootfs.diff_ids` and history, without the checkpoint layer or crab's labels (so
/// nothing takes it for a checkpoint image: a container started from it starts its command,
/// and as a base it is whole).
pub fn build_files(
    base: &Base,
    fs_layers: &[Descriptor],
    from: &Provenance<'_>,
) -> Result<CheckpointImage, ImageError> {
    assemble(base, fs_layers, None, from)
}

/// [`build`] with the checkpoint layer, [`build_files`] without.
fn assemble(
    base: &Base,
    fs_layers: &[Descriptor],
    checkpoint_layer: Option<&LayerBlob>,
    from: &Provenance<'_>,
) -> Result<CheckpointImage, ImageError> {
    let mut layers = base.layers.clone();
    for d in fs_layers {
        layers.push(descriptor(d.media_type.as_str(), &d.digest, d.size)?);
    }
    let mut diff_ids = base.diff_ids.clone();
    diff_ids.extend(fs_layers.iter().map(|d| d.diff_id.clone()));
    if let Some(c) = checkpoint_layer {
        layers.push(descriptor(MEDIA_TYPE_LAYER_ZSTD, &c.digest, c.size)?);
        diff_ids.push(c.diff_id.clone());
    }

    let mut config = base.config.clone();
    if !config.is_object() {
        config = json!({});
    }
    config["created"] = json!(from.created);
    config["rootfs"] = json!({"type": "layers", "diff_ids": diff_ids});
    let mut history = config["history"].as_array().cloned().unwrap_or_default();
    let n = fs_layers.len();
    for i in 0..n {
        let what = format!(
            "crab: fs layer {} of {n} of checkpoint {}",
            i + 1,
            from.source
        );
        history.push(json!({
            "created": from.created,
            "created_by": match checkpoint_layer {
                Some(_) => what,
                None => format!("{what} (turn {:?}), files only", from.turn_id),
            },
        }));
    }
    if checkpoint_layer.is_some() {
        history.push(json!({
            "created": from.created,
            "created_by": format!("crab: checkpoint {} (turn {:?})", from.source, from.turn_id),
            "comment": format!("{RESERVED_DIR}/ holds the checkpoint; crab hides it on start"),
        }));
    }
    config["history"] = Value::Array(history);
    if checkpoint_layer.is_some() {
        if !config["config"].is_object() {
            config["config"] = json!({});
        }
        if !config["config"]["Labels"].is_object() {
            config["config"]["Labels"] = json!({});
        }
        let labels = &mut config["config"]["Labels"];
        labels[LABEL_BASE_LAYERS] = json!(base.layers.len().to_string());
        labels[LABEL_SOURCE] = json!(from.source);
    }
    let config = serde_json::to_vec(&config).expect("a JSON value serializes");
    let manifest = ImageManifestBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageManifest)
        .config(descriptor_of(MediaType::ImageConfig, &config))
        .layers(layers.clone())
        .build()
        .expect("every field of the manifest is set");
    Ok(CheckpointImage {
        manifest: sorted_json(&manifest),
        config,
        layers,
        diff_ids,
        base_layers: base.layers.len(),
    })
}

/// Sets the image config's process to the container's (its runtime spec `spec`), so that an
/// image run without a command (`docker run IMG`, `ctr run IMG ID`) starts what the container
/// ran, even when the base image had no `Cmd`: `Cmd` is the spec's `process.args` (after the
/// base's `Entrypoint` when the args begin with it, else the `Entrypoint` is dropped), `Env`
/// the spec's environment without the `HOSTNAME=<hostname>` the runtime sets for each
/// container, `WorkingDir` its `cwd`. A spec without args leaves the config as it is.
pub fn set_process(config: &mut Value, spec: &Value) {
    let strings = |v: &Value| -> Option<Vec<String>> {
        v.as_array()?
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect()
    };
    let process = &spec["process"];
    let Some(args) = strings(&process["args"]).filter(|a| !a.is_empty()) else {
        return;
    };
    if !config.is_object() {
        *config = json!({});
    }
    if !config["config"].is_object() {
        config["config"] = json!({});
    }
    let c = &mut config["config"];
    let entrypoint = strings(&c["Entrypoint"]).unwrap_or_default();
    if !entrypoint.is_empty() && args.starts_with(&entrypoint) {
        c["Cmd"] = json!(args[entrypoint.len()..]);
    } else {
        c["Entrypoint"] = Value::Null;
        c["Cmd"] = json!(args);
    }
    if let Some(env) = strings(&process["env"]) {
        let own_hostname = spec["hostname"]
            .as_str()
            .filter(|h| !h.is_empty())
            .map(|h| format!("HOSTNAME={h}"));
        let env: Vec<String> = env
            .into_iter()
            .filter(|e| Some(e) != own_hostname.as_ref())
            .collect();
        c["Env"] = json!(env);
    }
    if let Some(cwd) = process["cwd"].as_str().filter(|d| d.starts_with('/')) {
        c["WorkingDir"] = json!(cwd);
    }
}

/// The base of a checkpoint image of a container without an image: `layers` (bottom first,
/// with their diff ids) read from its rootfs, and a config holding nothing else.
pub fn rootfs_base(layers: Vec<(oci::Descriptor, String)>) -> Base {
    let (os, arch) = host_platform();
    let n = layers.len();
    let history = (1..=n).map(|i| {
        HistoryBuilder::default()
            .created_by(format!("crab: layer {i} of {n} of the container's rootfs"))
            .build()
            .expect("history fields are optional")
    });
    let (layers, diff_ids): (Vec<_>, Vec<_>) = layers.into_iter().unzip();
    let rootfs = RootFsBuilder::default()
        .typ("layers")
        .diff_ids(diff_ids.clone())
        .build()
        .expect("every field of rootfs is set");
    let config = ImageConfigurationBuilder::default()
        .architecture(arch)
        .os(os)
        .config(ConfigBuilder::default().build().expect("an empty config"))
        .rootfs(rootfs)
        .history(history.collect::<Vec<_>>())
        .build()
        .expect("every required field of the config is set");
    Base {
        config: serde_json::to_value(config).expect("an image config serializes"),
        layers,
        diff_ids,
    }
}

/// Compresses the tar `input` into a zstd layer blob written to `out`.
pub fn compress_layer(mut input: impl Read, out: impl Write) -> io::Result<LayerBlob> {
    let mut encoder = zstd::stream::write::Encoder::new(Hashing::new(out), ZSTD_LEVEL)?;
    let mut diff = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        diff.update(&buf[..n]);
        encoder.write_all(&buf[..n])?;
    }
    let mut hashing = encoder.finish()?;
    hashing.flush()?;
    Ok(LayerBlob {
        digest: digest_string(hashing.hash),
        diff_id: digest_string(diff),
        size: hashing.len,
    })
}

/// OCI chain ids of every prefix: chain(0) = diff(0); chain(n) = sha256(chain(n-1) + " " + diff(n))
/// (the shim's, which checks them at a restore).
pub use crab_shim::restore::layers::chain_ids;

/// The platform a manifest list entry must have for this host (Go's GOARCH names).
pub fn host_platform() -> (&'static str, &'static str) {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    ("linux", arch)
}

/// From an image index, the manifest descriptor for this host (else the first one). The index
/// is read as JSON, not as oci-spec's `ImageIndex`: it may be Docker's manifest list, and an
/// entry for another platform that oci-spec would refuse is no reason to refuse this one.
pub fn pick_manifest(index: &Value) -> Result<oci::Descriptor, ImageError> {
    let manifests: Vec<Value> = index["manifests"].as_array().cloned().unwrap_or_default();
    let (os, arch) = host_platform();
    let pick = manifests
        .iter()
        .find(|m| m["platform"]["os"] == os && m["platform"]["architecture"] == arch)
        .or_else(|| manifests.first())
        .ok_or_else(|| bad("index")("no manifests".into()))?;
    serde_json::from_value(pick.clone()).map_err(|e| bad("index")(e.to_string()))
}

/// Writes `w` to `out` while hashing it.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
    len: u64,
}

impl<W: Write> Hashing<W> {
    fn new(inner: W) -> Self {
        Hashing {
            inner,
            hash: Sha256::new(),
            len: 0,
        }
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Where the CRIU image of a checkpoint is: its directory in the store (recipes instead of
/// pages files) and the store's chunk directory.
#[derive(Debug, Clone, Copy)]
pub struct CriuSource<'a> {
    pub dir: &'a Path,
    pub chunks: &'a Path,
}

/// Writes the checkpoint layer (tar, zstd) to `out`: `.crab-checkpoint/checkpoint.json` and,
/// with a process image, `.crab-checkpoint/criu/` holding the CRIU image with its pages files
/// rebuilt from their recipes. Entries are owned by root, modes 0700/0600, mtime 0.
pub fn write_checkpoint_layer(
    meta: &CheckpointMeta,
    below: &[String],
    criu: Option<CriuSource<'_>>,
    signer: &SigningKey,
    out: impl Write,
) -> Result<LayerBlob, ImageError> {
    let compressed = Hashing::new(out);
    let layer_path = Path::new("<checkpoint layer>");
    let encoder =
        zstd::stream::write::Encoder::new(compressed, ZSTD_LEVEL).map_err(io_err(layer_path))?;
    let mut tar = tar::Builder::new(Hashing::new(encoder));
    let root = Path::new(RESERVED_DIR);
    append(&mut tar, &root.join(""), None, layer_path)?;
    // Opaque: whatever lower layers (the container's own fs layers, which the agent wrote)
    // hold under the reserved directory is hidden, never merged into the checkpoint.
    append(
        &mut tar,
        &root.join(OPAQUE_WHITEOUT),
        Some((0, &mut io::empty())),
        layer_path,
    )?;
    let mut json = serde_json::to_vec_pretty(meta).expect("checkpoint meta serializes");
    json.push(b'\n');
    append(
        &mut tar,
        &root.join(META_FILE),
        Some((json.len() as u64, &mut &json[..])),
        layer_path,
    )?;
    let criu_files = match criu {
        Some(criu) => append_criu_image(&mut tar, &root.join(CRIU_DIR), criu)?,
        None => BTreeMap::new(),
    };
    // Last: the signature over the description, every CRIU file as written above and the
    // layers the image has below this one (`below`: their diff_ids, oldest first).
    let signature = provenance::sign(
        signer,
        Statement {
            checkpoint_json: provenance::sha256(&json),
            criu: criu_files,
            layers: Some(below.to_vec()),
            rootfs: None,
        },
    );
    append(
        &mut tar,
        &root.join(SIGNATURE_FILE),
        Some((signature.len() as u64, &mut &signature[..])),
        layer_path,
    )?;
    let uncompressed = tar.into_inner().map_err(io_err(layer_path))?;
    let diff_id = digest_string(uncompressed.hash);
    let mut compressed = uncompressed.inner.finish().map_err(io_err(layer_path))?;
    compressed.flush().map_err(io_err(layer_path))?;
    Ok(LayerBlob {
        digest: digest_string(compressed.hash),
        diff_id,
        size: compressed.len,
    })
}

/// `sha256:<hex>` of `data`.
pub fn sha256_of(data: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(data);
    digest_string(h)
}

/// One tar entry: a directory (`data` None, `path` ending in `/`) or a file.
fn append<W: Write>(
    tar: &mut tar::Builder<W>,
    path: &Path,
    data: Option<(u64, &mut dyn Read)>,
    context: &Path,
) -> Result<(), ImageError> {
    let mut h = tar::Header::new_gnu();
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    match data {
        None => {
            h.set_entry_type(tar::EntryType::Directory);
            h.set_mode(0o700);
            h.set_size(0);
            tar.append_data(&mut h, path, io::empty())
        }
        Some((len, reader)) => {
            h.set_entry_type(tar::EntryType::Regular);
            h.set_mode(0o600);
            h.set_size(len);
            // tar pads a short reader with zeros silently: count what was really read.
            let mut counted = Counted {
                inner: reader.take(len),
                n: 0,
            };
            tar.append_data(&mut h, path, &mut counted).and_then(|()| {
                if counted.n == len {
                    Ok(())
                } else {
                    Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("{} bytes of {len}", counted.n),
                    ))
                }
            })
        }
    }
    .map_err(|e| {
        if e.get_ref().is_some_and(|inner| inner.is::<PagesError>()) {
            let inner = e.into_inner().expect("checked").downcast::<PagesError>();
            ImageError::Pages(*inner.expect("checked"))
        } else {
            io_err(context)(e)
        }
    })
}

struct Counted<R> {
    inner: R,
    n: u64,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.n += n as u64;
        Ok(n)
    }
}

/// The CRIU image directory under `at`: its plain files as they are, its pages recipes as the
/// pages files they stand for (a pages file materialized next to its recipe is the same data:
/// the recipe wins). Temp files (dot names) are left out; anything but a plain file is an error.
fn append_criu_image<W: Write>(
    tar: &mut tar::Builder<W>,
    at: &Path,
    criu: CriuSource<'_>,
) -> Result<BTreeMap<String, FileDigest>, ImageError> {
    append(tar, &at.join(""), None, criu.dir)?;
    let readers = pages::materialized_readers(criu.dir, criu.chunks)?;
    let mut names: Vec<String> = Vec::new();
    for entry in fs::read_dir(criu.dir).map_err(io_err(criu.dir))? {
        let entry = entry.map_err(io_err(criu.dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if name.starts_with('.') || pages::is_recipe(&name) {
            continue;
        }
        let kind = entry.file_type().map_err(io_err(&path))?;
        if !kind.is_file() {
            let found = if kind.is_dir() {
                "a directory"
            } else if kind.is_symlink() {
                "a symlink"
            } else {
                "not a regular file"
            };
            return Err(ImageError::NotPlain { path, found });
        }
        if !readers.iter().any(|r| r.name() == name) {
            names.push(name);
        }
    }
    let mut readers: BTreeMap<String, pages::PagesReader> = readers
        .into_iter()
        .map(|r| (r.name().to_string(), r))
        .collect();
    names.extend(readers.keys().cloned());
    names.sort();
    let mut digests = BTreeMap::new();
    for name in names {
        let dest = at.join(&name);
        let digest = match readers.get_mut(&name) {
            Some(r) => {
                let len = r.len();
                let mut hashing = HashingReader::new(r);
                append(
                    tar,
                    &dest,
                    Some((len, &mut hashing as &mut dyn Read)),
                    &criu.dir.join(&name),
                )?;
                hashing.finish()
            }
            None => {
                let path = criu.dir.join(&name);
                let f = fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&path)
                    .map_err(io_err(&path))?;
                let len = f.metadata().map_err(io_err(&path))?.len();
                let mut hashing = HashingReader::new(f);
                append(
                    tar,
                    &dest,
                    Some((len, &mut hashing as &mut dyn Read)),
                    &path,
                )?;
                hashing.finish()
            }
        };
        digests.insert(name, digest);
    }
    Ok(digests)
}

#[cfg(test)]
mod tests;
