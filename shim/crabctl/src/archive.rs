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

use oci_spec::image::{ImageIndexBuilder, MediaType, OciLayoutBuilder};
use serde::Serialize;

use crate::image::{descriptor_of, sorted_json, CheckpointImage};

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
pub use oci_spec::image::ANNOTATION_REF_NAME;

/// One image of Docker's `manifest.json` (the `docker save` list, which `docker load` reads):
/// its config and layers by their paths in the archive. No OCI type describes it.
#[derive(Debug, Serialize)]
struct DockerArchiveImage {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "Layers")]
    layers: Vec<String>,
    #[serde(rename = "RepoTags")]
    repo_tags: Vec<String>,
}

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
    let mut manifest_desc = descriptor_of(MediaType::ImageManifest, &image.manifest);
    manifest_desc.set_annotations(Some(
        [
            (ANNOTATION_IMAGE_NAME.to_string(), name.clone()),
            (ANNOTATION_REF_NAME.to_string(), tag),
        ]
        .into(),
    ));
    let index = ImageIndexBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageIndex)
        .manifests(vec![manifest_desc])
        .build()
        .expect("every field of the index is set");
    let layers = image
        .layers
        .iter()
        .map(|l| blob_path(l.digest().as_ref()))
        .collect::<Result<Vec<_>, _>>()?;
    let docker = [DockerArchiveImage {
        config: blob_path(&image.config_digest())?,
        layers,
        repo_tags: vec![name],
    }];
    // Keys sorted, as these files have always had them.
    Ok((sorted_json(&index), sorted_json(&docker)))
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
    let layout = OciLayoutBuilder::default()
        .image_layout_version("1.0.0")
        .build()
        .expect("the layout's one field is set");
    add("oci-layout", Blob::Bytes(&sorted_json(&layout)))?;
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
        let digest = layer.digest().as_ref();
        if !seen.insert(digest) {
            continue;
        }
        let data = blob(digest)
            .ok_or_else(|| io::Error::other(format!("layer {digest} has no source")))?;
        if let Blob::File(p) = data {
            let size = fs::metadata(p)?.len();
            if size != layer.size() {
                return Err(io::Error::other(format!(
                    "layer {digest} is {size} bytes in {}, not {}",
                    p.display(),
                    layer.size()
                )));
            }
        }
        add(&blob_path(digest)?, data)?;
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

    use oci_spec::image::ImageManifestBuilder;
    use serde_json::json;

    use super::*;
    use crate::image::sha256_of;

    fn image(layers: &[&[u8]]) -> CheckpointImage {
        let config = br#"{"rootfs":{}}"#.to_vec();
        let layers: Vec<_> = layers
            .iter()
            .map(|l| descriptor_of(MediaType::ImageLayerZstd, l))
            .collect();
        let manifest = ImageManifestBuilder::default()
            .schema_version(2u32)
            .config(descriptor_of(MediaType::ImageConfig, &config))
            .layers(layers.clone())
            .build()
            .unwrap();
        let manifest = sorted_json(&manifest);
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

    /// What the hand-written JSON made of a fixed image before oci-spec's types built it (the
    /// manifest, config, index.json and Docker's manifest.json, taken from the old code): the
    /// same bytes, so an image exported again has the same digests, and `docker load` and
    /// `ctr import` get the same media types, digests, sizes and annotations.
    #[test]
    fn the_documents_are_those_the_hand_written_json_made() {
        use crab_shim::checkpoint::store::Descriptor;

        use crate::image::*;

        let hexd = |c: char| format!("sha256:{}", c.to_string().repeat(64));
        let manifest = json!({
            "schemaVersion": 2,
            "config": {"mediaType": MediaType::ImageConfig, "digest": hexd('c'), "size": 500},
            "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                        "digest": hexd('a'), "size": 1000, "annotations": {"x": "y"},
                        "urls": ["https://example.com/a"]}],
        });
        let config = json!({
            "architecture": "amd64", "os": "linux",
            "config": {"Env": ["PATH=/usr/bin"], "Cmd": ["bash"], "Healthcheck": {"Test": ["NONE"]}},
            "rootfs": {"type": "layers", "diff_ids": [hexd('d')]},
            "history": [{"created_by": "add layer"}],
        });
        let base = base_of(&manifest, &config).unwrap();
        let fs = Descriptor {
            digest: hexd('1'),
            diff_id: hexd('2'),
            size: 10,
            media_type: MEDIA_TYPE_LAYER_ZSTD.into(),
        };
        let from = Provenance {
            source: "ns/c@3",
            turn_id: "t3",
            created: "2026-01-01T00:00:00.000Z",
        };
        let cp = LayerBlob {
            digest: hexd('e'),
            diff_id: hexd('f'),
            size: 77,
        };
        let text = |b: &[u8]| String::from_utf8(b.to_vec()).unwrap();
        let img = build(&base, std::slice::from_ref(&fs), &cp, &from).unwrap();
        assert_eq!(
            text(&img.manifest),
            r#"{"config":{"digest":"sha256:e3955807d828f29bba3682203f712e41c06db7e160a53b90ddae04468c62b740","mediaType":"application/vnd.oci.image.config.v1+json","size":806},"layers":[{"annotations":{"x":"y"},"digest":"sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","mediaType":"application/vnd.docker.image.rootfs.diff.tar.gzip","size":1000,"urls":["https://example.com/a"]},{"digest":"sha256:1111111111111111111111111111111111111111111111111111111111111111","mediaType":"application/vnd.oci.image.layer.v1.tar+zstd","size":10},{"digest":"sha256:eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee","mediaType":"application/vnd.oci.image.layer.v1.tar+zstd","size":77}],"mediaType":"application/vnd.oci.image.manifest.v1+json","schemaVersion":2}"#
        );
        assert_eq!(
            text(&img.config),
            r#"{"architecture":"amd64","config":{"Cmd":["bash"],"Env":["PATH=/usr/bin"],"Healthcheck":{"Test":["NONE"]},"Labels":{"io.crab.checkpoint.base-layers":"1","io.crab.checkpoint.source":"ns/c@3"}},"created":"2026-01-01T00:00:00.000Z","history":[{"created_by":"add layer"},{"created":"2026-01-01T00:00:00.000Z","created_by":"crab: fs layer 1 of 1 of checkpoint ns/c@3"},{"comment":".crab-checkpoint/ holds the checkpoint; crab hides it on start","created":"2026-01-01T00:00:00.000Z","created_by":"crab: checkpoint ns/c@3 (turn \"t3\")"}],"os":"linux","rootfs":{"diff_ids":["sha256:dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd","sha256:2222222222222222222222222222222222222222222222222222222222222222","sha256:ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"],"type":"layers"}}"#
        );
        let files = build_files(&base, &[fs], &from).unwrap();
        assert_eq!(
            text(&files.manifest),
            r#"{"config":{"digest":"sha256:8242277ab3fe9437c1067494711bc636b9358b41b583de486aad95b67aa9c76d","mediaType":"application/vnd.oci.image.config.v1+json","size":506},"layers":[{"annotations":{"x":"y"},"digest":"sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","mediaType":"application/vnd.docker.image.rootfs.diff.tar.gzip","size":1000,"urls":["https://example.com/a"]},{"digest":"sha256:1111111111111111111111111111111111111111111111111111111111111111","mediaType":"application/vnd.oci.image.layer.v1.tar+zstd","size":10}],"mediaType":"application/vnd.oci.image.manifest.v1+json","schemaVersion":2}"#
        );
        assert_eq!(
            text(&files.config),
            r#"{"architecture":"amd64","config":{"Cmd":["bash"],"Env":["PATH=/usr/bin"],"Healthcheck":{"Test":["NONE"]}},"created":"2026-01-01T00:00:00.000Z","history":[{"created_by":"add layer"},{"created":"2026-01-01T00:00:00.000Z","created_by":"crab: fs layer 1 of 1 of checkpoint ns/c@3 (turn \"t3\"), files only"}],"os":"linux","rootfs":{"diff_ids":["sha256:dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd","sha256:2222222222222222222222222222222222222222222222222222222222222222"],"type":"layers"}}"#
        );
        let (index, docker) = index_and_manifest_json("localhost/crab/cp:3", &img).unwrap();
        assert_eq!(
            text(&index),
            r#"{"manifests":[{"annotations":{"io.containerd.image.name":"localhost/crab/cp:3","org.opencontainers.image.ref.name":"3"},"digest":"sha256:81f04bd2e6776b1a20fcf3664d1647bf89ce90690754d9de5b051ed7dd76cf11","mediaType":"application/vnd.oci.image.manifest.v1+json","size":771}],"mediaType":"application/vnd.oci.image.index.v1+json","schemaVersion":2}"#
        );
        assert_eq!(
            text(&docker),
            r#"[{"Config":"blobs/sha256/e3955807d828f29bba3682203f712e41c06db7e160a53b90ddae04468c62b740","Layers":["blobs/sha256/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","blobs/sha256/1111111111111111111111111111111111111111111111111111111111111111","blobs/sha256/eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee"],"RepoTags":["localhost/crab/cp:3"]}]"#
        );
        let (index, docker) = index_and_manifest_json("localhost:5000/x", &img).unwrap();
        assert_eq!(
            text(&index),
            r#"{"manifests":[{"annotations":{"io.containerd.image.name":"localhost:5000/x:latest","org.opencontainers.image.ref.name":"latest"},"digest":"sha256:81f04bd2e6776b1a20fcf3664d1647bf89ce90690754d9de5b051ed7dd76cf11","mediaType":"application/vnd.oci.image.manifest.v1+json","size":771}],"mediaType":"application/vnd.oci.image.index.v1+json","schemaVersion":2}"#
        );
        assert_eq!(
            text(&docker),
            r#"[{"Config":"blobs/sha256/e3955807d828f29bba3682203f712e41c06db7e160a53b90ddae04468c62b740","Layers":["blobs/sha256/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","blobs/sha256/1111111111111111111111111111111111111111111111111111111111111111","blobs/sha256/eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee"],"RepoTags":["localhost:5000/x:latest"]}]"#
        );
        // These depend on the host's platform (Go's names).
        let (os, arch) = host_platform();
        let layer = descriptor(MEDIA_TYPE_LAYER_ZSTD, &hexd('5'), 5).unwrap();
        let rootfs = rootfs_base(vec![(layer, hexd('6'))]);
        let expected = r#"{"architecture":"amd64","config":{},"history":[{"created_by":"crab: layer 1 of 1 of the container's rootfs"}],"os":"linux","rootfs":{"diff_ids":["sha256:6666666666666666666666666666666666666666666666666666666666666666"],"type":"layers"}}"#;
        let expected = expected.replace(r#""amd64""#, &format!("{arch:?}"));
        assert_eq!(
            serde_json::to_string(&rootfs.config).unwrap(),
            expected.replace(r#""linux""#, &format!("{os:?}"))
        );
        let index = json!({"manifests": [
            {"mediaType": MediaType::ImageManifest, "digest": hexd('1'), "size": 1,
             "platform": {"os": "linux", "architecture": "s390x"}},
            {"mediaType": MediaType::ImageManifest, "digest": hexd('2'), "size": 1,
             "platform": {"os": os, "architecture": arch}},
        ]});
        let picked: Value = serde_json::to_value(pick_manifest(&index).unwrap()).unwrap();
        let expected: Value = serde_json::from_str(&r#"{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:2222222222222222222222222222222222222222222222222222222222222222","size":1,"platform":{"architecture":"amd64","os":"linux"}}"#.replace("amd64", arch)).unwrap();
        assert_eq!(picked, expected);
    }
}
