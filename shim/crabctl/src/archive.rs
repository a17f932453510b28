//! A checkpoint image as an image archive file, the form `docker load` and `ctr images import`
//! read (and `ctr images export` writes): an OCI image layout (`oci-layout`, `index.json`,
//! `blobs/sha256/<hex>`) plus Docker's `manifest.json` naming the config and layers by path.
//!
//! dockerd with its overlay2 graph driver cannot see containerd's images, so a checkpoint image
//! reaches it only this way. The file is written under a temporary name next to its place and
//! renamed there when complete: a failed export leaves no half archive.

use std::{
    collections::HashSet,
    fs::{self, File},
    io::{self, BufWriter, Write},
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
};

use serde_json::json;

use crate::image::{CheckpointImage, OciDescriptor, MEDIA_TYPE_INDEX, MEDIA_TYPE_MANIFEST};

/// Where the bytes of a blob of the archive come from.
#[derive(Debug, Clone, Copy)]
pub enum Blob<'a> {
    File(&'a Path),
    Bytes(&'a [u8]),
}

/// The annotation containerd's importer (and dockerd's containerd image store) names the
/// image by.
pub const ANNOTATION_IMAGE_NAME: &str = "io.containerd.image.name";
/// The OCI annotation of a layout's manifest: the reference's tag.
pub const ANNOTATION_REF_NAME: &str = "org.opencontainers.image.ref.name";

/// `reference` with a tag: `:latest` added when it has neither tag nor digest (as `docker`
/// names an untagged reference).
pub fn tagged(reference: &str) -> String {
    let last = reference.rsplit('/').next().unwrap_or(reference);
    if last.contains(':') || last.contains('@') {
        reference.to_string()
    } else {
        format!("{reference}:latest")
    }
}

/// The archive's path of blob `digest`.
pub fn blob_path(digest: &str) -> Result<String, io::Error> {
    let hex = digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| io::Error::other(format!("{digest:?} is not a sha256 digest")))?;
    Ok(format!("blobs/sha256/{hex}"))
}

/// The `index.json` and `manifest.json` of an archive of `image` named `reference`.
pub fn index_and_manifest_json(
    reference: &str,
    image: &CheckpointImage,
) -> Result<(Vec<u8>, Vec<u8>), io::Error> {
    let name = tagged(reference);
    let tag = name
        .rsplit('/')
        .next()
        .and_then(|last| last.split_once(':'))
        .map(|(_, t)| t.to_string())
        .unwrap_or_else(|| "latest".into());
    let mut manifest_desc = OciDescriptor::new(
        MEDIA_TYPE_MANIFEST,
        &image.manifest_digest(),
        image.manifest.len() as u64,
    );
    manifest_desc.extra.insert(
        "annotations".into(),
        json!({ANNOTATION_IMAGE_NAME: name, ANNOTATION_REF_NAME: tag}),
    );
    let index = json!({
        "schemaVersion": 2,
        "mediaType": MEDIA_TYPE_INDEX,
        "manifests": [manifest_desc],
    });
    let layers = image
        .layers
        .iter()
        .map(|l| blob_path(&l.digest))
        .collect::<Result<Vec<_>, _>>()?;
    let docker = json!([{
        "Config": blob_path(&image.config_digest())?,
        "RepoTags": [name],
        "Layers": layers,
    }]);
    Ok((
        serde_json::to_vec(&index).expect("JSON serializes"),
        serde_json::to_vec(&docker).expect("JSON serializes"),
    ))
}

/// A regular file's header: root's, mode 0644, mtime 0 (the archive of an image is the same
/// whenever it is written).
fn header(size: u64) -> tar::Header {
    let mut h = tar::Header::new_ustar();
    h.set_size(size);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_entry_type(tar::EntryType::Regular);
    h
}

/// Writes the archive of `image` named `reference` to `out`; `blob(digest)` says where each
/// layer's bytes are (the config and manifest come from `image`). Returns the archive's size.
pub fn write<'a>(
    out: &Path,
    reference: &str,
    image: &CheckpointImage,
    blob: &dyn Fn(&str) -> Option<Blob<'a>>,
) -> Result<u64, io::Error> {
    let name = out
        .file_name()
        .ok_or_else(|| io::Error::other(format!("{} names no file", out.display())))?;
    let dir = out.parent().filter(|p| !p.as_os_str().is_empty());
    let tmp: PathBuf = dir.unwrap_or(Path::new(".")).join(format!(
        ".{}.crabctl-{}",
        name.to_string_lossy(),
        crate::client::unique()
    ));
    let written = write_to(&tmp, reference, image, blob).and_then(|size| {
        fs::rename(&tmp, out)?;
        Ok(size)
    });
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written
}

fn write_to<'a>(
    tmp: &Path,
    reference: &str,
    image: &CheckpointImage,
    blob: &dyn Fn(&str) -> Option<Blob<'a>>,
) -> Result<u64, io::Error> {
    let file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(tmp)?;
    let mut tar = tar::Builder::new(BufWriter::with_capacity(1 << 20, file));
    let mut add = |path: &str, data: Blob<'_>| -> io::Result<()> {
        match data {
            Blob::Bytes(bytes) => tar.append_data(&mut header(bytes.len() as u64), path, bytes),
            Blob::File(p) => {
                let f = File::open(p)?;
                let size = f.metadata()?.len();
                tar.append_data(&mut header(size), path, f)
            }
        }
    };
    let (index, docker) = index_and_manifest_json(reference, image)?;
    add(
        "oci-layout",
        Blob::Bytes(br#"{"imageLayoutVersion":"1.0.0"}"#),
    )?;
    add("index.json", Blob::Bytes(&index))?;
    add("manifest.json", Blob::Bytes(&docker))?;
    let mut seen = HashSet::new();
    add(
        &blob_path(&image.manifest_digest())?,
        Blob::Bytes(&image.manifest),
    )?;
    add(
        &blob_path(&image.config_digest())?,
        Blob::Bytes(&image.config),
    )?;
    for layer in &image.layers {
        if !seen.insert(layer.digest.clone()) {
            continue;
        }
        let data = blob(&layer.digest)
            .ok_or_else(|| io::Error::other(format!("layer {} has no source", layer.digest)))?;
        if let Blob::File(p) = data {
            let size = fs::metadata(p)?.len();
            if size != layer.size {
                return Err(io::Error::other(format!(
                    "layer {} is {size} bytes in {}, not {}",
                    layer.digest,
                    p.display(),
                    layer.size
                )));
            }
        }
        add(&blob_path(&layer.digest)?, data)?;
    }
    let mut out = tar.into_inner()?;
    out.flush()?;
    let file = out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok(file.metadata()?.len())
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use serde_json::Value;

    use super::*;
    use crate::image::{sha256_of, MEDIA_TYPE_CONFIG, MEDIA_TYPE_LAYER_ZSTD};

    fn image(layers: &[&[u8]]) -> CheckpointImage {
        let config = br#"{"rootfs":{}}"#.to_vec();
        let layers: Vec<OciDescriptor> = layers
            .iter()
            .map(|l| OciDescriptor::new(MEDIA_TYPE_LAYER_ZSTD, &sha256_of(l), l.len() as u64))
            .collect();
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "config": OciDescriptor::new(MEDIA_TYPE_CONFIG, &sha256_of(&config), config.len() as u64),
            "layers": layers,
        }))
        .unwrap();
        CheckpointImage {
            manifest,
            config,
            layers,
            diff_ids: vec![],
            base_layers: 0,
        }
    }

    #[test]
    fn names_are_tagged_like_docker_names_them() {
        assert_eq!(tagged("localhost/crab/x"), "localhost/crab/x:latest");
        assert_eq!(tagged("localhost:5000/x"), "localhost:5000/x:latest");
        assert_eq!(tagged("localhost:5000/x:v1"), "localhost:5000/x:v1");
        assert_eq!(tagged("x@sha256:ab"), "x@sha256:ab");
        assert!(blob_path("sha256:xyz").is_err());
        assert!(blob_path("sha256:../../etc/passwd").is_err());
    }

    #[test]
    fn the_archive_is_an_oci_layout_with_dockers_manifest() {
        let dir = tempfile::tempdir().unwrap();
        let (l1, l2) = (b"layer one".to_vec(), b"layer two".to_vec());
        let img = image(&[&l1, &l2, &l1]);
        let l2_file = dir.path().join("l2");
        fs::write(&l2_file, &l2).unwrap();
        let out = dir.path().join("x.tar");
        fs::write(&out, b"old").unwrap();
        let source = |d: &str| -> Option<Blob> {
            if d == sha256_of(&l1) {
                Some(Blob::Bytes(&l1))
            } else if d == sha256_of(&l2) {
                Some(Blob::File(&l2_file))
            } else {
                None
            }
        };
        let size = write(&out, "localhost/crab/cp:3", &img, &source).unwrap();
        let bytes = fs::read(&out).unwrap();
        assert_eq!(size, bytes.len() as u64);
        let mut entries = std::collections::BTreeMap::new();
        for e in tar::Archive::new(&bytes[..]).entries().unwrap() {
            let mut e = e.unwrap();
            let path = e.path().unwrap().to_string_lossy().into_owned();
            let mut data = Vec::new();
            e.read_to_end(&mut data).unwrap();
            assert!(entries.insert(path, data).is_none(), "one entry per path");
        }
        let blob = |d: &str| &entries[&blob_path(d).unwrap()];
        assert_eq!(blob(&sha256_of(&l1)), &l1);
        assert_eq!(blob(&sha256_of(&l2)), &l2);
        assert_eq!(blob(&img.manifest_digest()), &img.manifest);
        assert_eq!(blob(&img.config_digest()), &img.config);
        assert_eq!(entries.len(), 3 + 4, "{:?}", entries.keys());
        let index: Value = serde_json::from_slice(&entries["index.json"]).unwrap();
        let m = &index["manifests"][0];
        assert_eq!(m["digest"], img.manifest_digest());
        assert_eq!(
            m["annotations"][ANNOTATION_IMAGE_NAME],
            "localhost/crab/cp:3"
        );
        assert_eq!(m["annotations"][ANNOTATION_REF_NAME], "3");
        let docker: Value = serde_json::from_slice(&entries["manifest.json"]).unwrap();
        assert_eq!(docker[0]["RepoTags"], json!(["localhost/crab/cp:3"]));
        assert_eq!(docker[0]["Layers"].as_array().unwrap().len(), 3);
        assert_eq!(
            docker[0]["Config"],
            blob_path(&img.config_digest()).unwrap()
        );
        let layout: Value = serde_json::from_slice(&entries["oci-layout"]).unwrap();
        assert_eq!(layout["imageLayoutVersion"], "1.0.0");
        // A layer without a source, or of the wrong size: no archive, the old file stays, no
        // temporary file is left.
        let none = |_: &str| -> Option<Blob> { None };
        assert!(write(&out, "x", &img, &none).is_err());
        fs::write(&l2_file, b"short").unwrap();
        let e = write(&out, "x", &img, &source).unwrap_err();
        assert!(e.to_string().contains("not 9"), "{e}");
        assert_eq!(fs::read(&out).unwrap(), bytes);
        let left: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 2, "{left:?}");
    }
}
