//! Docker Engine as a client of crab: recognising the containers dockerd owns, and asking
//! dockerd which container a name (or an id prefix) stands for.
//!
//! dockerd runs its containers in containerd namespace [`NAMESPACE`] (`moby`); the container
//! records carry no image and no snapshot, and the container's name lives only in dockerd. A
//! name is resolved with one `GET /containers/{name}/json` over dockerd's unix socket
//! (`DOCKER_HOST`, default [`DEFAULT_HOST`]): a minimal HTTP/1.1 client, since the answer is
//! one small JSON document. The response is hostile input: its size is bounded
//! ([`MAX_RESPONSE`]), every length in it is checked against what arrived, and anything that is
//! not a well-formed answer is an error, never a guess.

use std::{
    io::{Read, Write},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::Duration,
};

use containerd_client::services::v1::Container;
use serde_json::Value;

/// The containerd namespace dockerd runs its containers in.
pub const NAMESPACE: &str = "moby";
/// The label dockerd puts on every container record it creates (its bundle directory).
pub const LABEL_BUNDLE: &str = "com.docker/engine.bundle.path";
/// Where Docker's clients find dockerd without `DOCKER_HOST`.
pub const DEFAULT_HOST: &str = "unix:///var/run/docker.sock";
/// Bound on a response from dockerd (headers and body): an inspect document is a few KiB.
pub const MAX_RESPONSE: usize = 4 << 20;
/// Bound on the response headers.
const MAX_HEADERS: usize = 64 << 10;
/// How long dockerd may take to connect, accept the request and answer.
const TIMEOUT: Duration = Duration::from_secs(10);

/// Whether dockerd owns `record` (it is in namespace `moby` or carries dockerd's label).
pub fn is_docker_owned(record: &Container, namespace: &str) -> bool {
    namespace == NAMESPACE || record.labels.contains_key(LABEL_BUNDLE)
}

/// Why fork, rollback and recover refuse a container dockerd owns. A rollback or recovery
/// kills its task and replaces its record behind dockerd's back: dockerd handles the old
/// task's exit (marks the container exited, applies its restart policy, removes it with
/// `--rm`) on the new one, and it mounts and unmounts the rootfs itself. A fork would be a
/// container dockerd does not know (no name, network or cleanup), on a rootfs nobody mounted
/// for it. A checkpoint image run with `docker run` restores through dockerd instead.
pub fn refusal(container: &str, namespace: &str, op: &str) -> String {
    let why = match op {
        "fork" => {
            "a fork would be a container dockerd does not know (no name, network or cleanup) \
             on a rootfs dockerd never mounted for it"
        }
        _ => {
            "it would kill the task and replace the record behind dockerd's back, and dockerd \
             would handle the old task's exit (restart policy, --rm) on the new one"
        }
    };
    format!(
        "{container} is run by Docker (dockerd owns its task, record and rootfs), so crabctl \
         refuses a {op} of it: {why}; export the checkpoint and start it through Docker instead: \
         crabctl -n {namespace} export {container} --turn T REF --output FILE.tar && \
         docker load -i FILE.tar && docker run --runtime io.containerd.crab.v1 REF \
         (with Docker's containerd image store, export without --output: REF is then one of \
         Docker's images)"
    )
}

/// Where dockerd listens, from a `DOCKER_HOST` value (`None`: unset or empty).
pub fn socket_path(docker_host: Option<&str>) -> Result<PathBuf, String> {
    let host = docker_host
        .filter(|h| !h.is_empty())
        .unwrap_or(DEFAULT_HOST);
    match host.strip_prefix("unix://") {
        Some(path) if path.starts_with('/') => Ok(PathBuf::from(path)),
        Some(_) => Err(format!(
            "DOCKER_HOST={host}: a unix socket needs an absolute path (unix:///path)"
        )),
        None => Err(format!(
            "DOCKER_HOST={host}: crabctl reaches dockerd through a unix socket only \
             (unix:///path); dockerd runs on the host crab runs on"
        )),
    }
}

/// Whether `name` can be a Docker container name or id prefix (`[a-zA-Z0-9][a-zA-Z0-9_.-]*`,
/// with an optional leading `/` as dockerd prints names): only such names are put in a URL.
pub fn is_docker_name(name: &str) -> bool {
    let name = name.strip_prefix('/').unwrap_or(name);
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        && name.len() <= 255
}

/// A response from dockerd: its status and (de-chunked) body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

/// Parses a whole HTTP/1.1 response (the connection closed after it): the status line, the
/// headers, and the body by `Transfer-Encoding: chunked`, else `Content-Length`, else up to
/// the end. Every length is checked against the bytes there are.
pub fn parse_response(raw: &[u8]) -> Result<Response, String> {
    let head_end = raw
        .windows(4)
        .take(MAX_HEADERS)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| {
            if raw.len() > MAX_HEADERS {
                format!("no end of the headers in the first {MAX_HEADERS} bytes")
            } else {
                "the response ends within its headers".to_string()
            }
        })?;
    let head = std::str::from_utf8(&raw[..head_end])
        .map_err(|_| "the response headers are not text".to_string())?;
    let rest = &raw[head_end + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let (version, code) = (parts.next().unwrap_or_default(), parts.next());
    if !version.starts_with("HTTP/1.") {
        return Err(format!("not an HTTP/1 response: {:.80}", status_line));
    }
    let status = code
        .filter(|c| c.len() == 3 && c.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| format!("bad status line: {:.80}", status_line))?;
    let (mut length, mut chunked) = (None, false);
    for line in lines {
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| format!("bad header line: {line:.80}"))?;
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            let n = value
                .parse::<usize>()
                .map_err(|_| format!("bad Content-Length: {value:.40}"))?;
            if length.is_some_and(|l| l != n) {
                return Err("conflicting Content-Length headers".into());
            }
            length = Some(n);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            if !value.eq_ignore_ascii_case("chunked") {
                return Err(format!("unsupported Transfer-Encoding: {value:.40}"));
            }
            chunked = true;
        }
    }
    let body = if chunked {
        dechunk(rest)?
    } else if let Some(n) = length {
        if rest.len() < n {
            return Err(format!(
                "the body ends after {} of its {n} bytes",
                rest.len()
            ));
        }
        rest[..n].to_vec()
    } else {
        rest.to_vec()
    };
    Ok(Response { status, body })
}

/// Decodes a chunked body: `<hex size>[;ext]\r\n<data>\r\n` ... `0\r\n[trailers]\r\n`.
fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    loop {
        let line_end = rest
            .windows(2)
            .take(1024)
            .position(|w| w == b"\r\n")
            .ok_or("a chunk size line is cut off or too long")?;
        let line = std::str::from_utf8(&rest[..line_end]).map_err(|_| "bad chunk size line")?;
        let size_text = line.split(';').next().unwrap_or_default().trim();
        if size_text.is_empty() || size_text.len() > 8 {
            return Err(format!("bad chunk size: {size_text:.20}"));
        }
        let size = usize::from_str_radix(size_text, 16)
            .map_err(|_| format!("bad chunk size: {size_text:.20}"))?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            // Trailers (ignored) up to the final empty line; a missing end is tolerated as the
            // connection closed after the last chunk.
            return Ok(body);
        }
        if rest.len() < size + 2 {
            return Err(format!(
                "a chunk of {size} bytes is cut off after {}",
                rest.len()
            ));
        }
        if &rest[size..size + 2] != b"\r\n" {
            return Err("a chunk does not end where its size says".into());
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

/// Sends `GET path` to dockerd at `socket` and reads the whole response (at most
/// [`MAX_RESPONSE`] bytes, within [`TIMEOUT`] per read and write).
pub fn get(socket: &Path, path: &str) -> Result<Response, String> {
    let mut stream = UnixStream::connect(socket)
        .map_err(|e| format!("cannot connect to dockerd at {}: {e}", socket.display()))?;
    stream
        .set_read_timeout(Some(TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(TIMEOUT)))
        .map_err(|e| format!("{}: {e}", socket.display()))?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: docker\r\nUser-Agent: crabctl\r\nConnection: close\r\n\r\n"
    );
    stream
        .write_all(request.as_bytes())
        .map_err(|e| format!("sending to dockerd at {}: {e}", socket.display()))?;
    let mut raw = Vec::new();
    stream
        .take(MAX_RESPONSE as u64 + 1)
        .read_to_end(&mut raw)
        .map_err(|e| format!("reading from dockerd at {}: {e}", socket.display()))?;
    if raw.len() > MAX_RESPONSE {
        return Err(format!(
            "dockerd at {} answered with more than {MAX_RESPONSE} bytes",
            socket.display()
        ));
    }
    parse_response(&raw).map_err(|e| format!("dockerd at {}: {e}", socket.display()))
}

/// What dockerd said about a container name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The container's full id, its name as dockerd prints it (without the `/`), and the
    /// whole inspect document.
    Found {
        id: String,
        name: String,
        doc: Value,
    },
    /// dockerd knows no such container.
    NotFound,
}

/// Interprets dockerd's answer to `GET /containers/{name}/json`.
pub fn parse_inspect(response: &Response) -> Result<Lookup, String> {
    let message = || {
        serde_json::from_slice::<Value>(&response.body)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_string))
            .unwrap_or_else(|| {
                String::from_utf8_lossy(&response.body[..response.body.len().min(200)]).into_owned()
            })
    };
    match response.status {
        200 => {}
        404 => return Ok(Lookup::NotFound),
        status => return Err(format!("dockerd answered {status}: {}", message())),
    }
    let doc: Value = serde_json::from_slice(&response.body)
        .map_err(|e| format!("dockerd's answer is not JSON: {e}"))?;
    let id = doc["Id"].as_str().unwrap_or_default();
    if id.len() != 64 || !id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(format!(
            "dockerd's answer has no container id: Id {:.80?}",
            id
        ));
    }
    let name = doc["Name"].as_str().unwrap_or_default();
    Ok(Lookup::Found {
        id: id.to_string(),
        name: name.strip_prefix('/').unwrap_or(name).to_string(),
        doc,
    })
}

/// The parts of a runtime spec crabctl uses, from dockerd's inspect document of a container:
/// for a container that has exited, whose record (and spec) dockerd removed from containerd.
/// `process.args` is `Path` + `Args`, `env` and `cwd` the config's, `hostname` its hostname,
/// `root.path` the graph driver's merged directory; what is missing or not text is left out.
pub fn spec_from_inspect(doc: &Value) -> Value {
    let text = |v: &Value| v.as_str().filter(|s| !s.is_empty()).map(str::to_string);
    let texts = |v: &Value| -> Option<Vec<String>> {
        v.as_array()?
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect()
    };
    let mut spec = serde_json::json!({"process": {}});
    if let (Some(path), Some(args)) = (text(&doc["Path"]), texts(&doc["Args"])) {
        let mut all = vec![path];
        all.extend(args);
        spec["process"]["args"] = all.into();
    }
    if let Some(env) = texts(&doc["Config"]["Env"]) {
        spec["process"]["env"] = env.into();
    }
    if let Some(cwd) = text(&doc["Config"]["WorkingDir"]) {
        spec["process"]["cwd"] = cwd.into();
    }
    if let Some(hostname) = text(&doc["Config"]["Hostname"]) {
        spec["hostname"] = hostname.into();
    }
    if let Some(merged) = text(&doc["GraphDriver"]["Data"]["MergedDir"]) {
        spec["root"] = serde_json::json!({ "path": merged });
    }
    spec
}

/// A stand-in for the containerd record of Docker container `id` that has exited (dockerd
/// removes the record when the task ends, and keeps the container): dockerd's label, and the
/// spec of [`spec_from_inspect`]. No runtime options: its crab config is `--config`'s or the
/// default.
pub fn exited_record(id: &str, doc: &Value) -> Container {
    Container {
        id: id.to_string(),
        labels: [(LABEL_BUNDLE.to_string(), String::new())].into(),
        spec: Some(prost_types::Any {
            type_url: SPEC_TYPE_URL.to_string(),
            value: serde_json::to_vec(&spec_from_inspect(doc)).expect("JSON serializes"),
        }),
        ..Default::default()
    }
}

/// The type of a runtime spec in a container record.
pub const SPEC_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/Spec";

/// Asks dockerd at `DOCKER_HOST` (`docker_host`) which container `name` is (a name or an id
/// prefix, as `docker inspect` takes it).
pub fn lookup(docker_host: Option<&str>, name: &str) -> Result<Lookup, String> {
    if !is_docker_name(name) {
        return Ok(Lookup::NotFound);
    }
    let socket = socket_path(docker_host)?;
    parse_inspect(&get(&socket, &format!("/containers/{name}/json"))?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(raw: &[u8]) -> Response {
        parse_response(raw).unwrap_or_else(|e| panic!("{e}: {:?}", String::from_utf8_lossy(raw)))
    }

    fn err(raw: &[u8]) -> String {
        match parse_response(raw) {
            Ok(r) => panic!("parsed: {r:?}"),
            Err(e) => e,
        }
    }

    const ID: &str = "3f4e2b0c9d1a8e7f6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a";

    #[test]
    fn parses_length_chunked_and_close_delimited_bodies() {
        let r = ok(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 4\r\n\r\n{}\r\nextra");
        assert_eq!((r.status, r.body.as_slice()), (200, &b"{}\r\n"[..]));
        let r = ok(b"HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n3\r\n{\"a\r\n5;x=y\r\n\":1}\n\r\n0\r\n\r\n");
        assert_eq!(r.body, b"{\"a\":1}\n");
        let r = ok(b"HTTP/1.0 404 Not Found\r\n\r\n{\"message\":\"No such container: x\"}");
        assert_eq!(r.status, 404);
        assert_eq!(parse_inspect(&r).unwrap(), Lookup::NotFound);
        // The final chunk without its closing line (the peer closed): still the whole body.
        assert_eq!(
            ok(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n").body,
            b"x"
        );
    }

    #[test]
    fn hostile_responses_are_errors_not_guesses() {
        for (raw, needle) in [
            (&b""[..], "ends within its headers"),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n",
                "ends within its headers",
            ),
            (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1 response"),
            (b"HTTP/1.1 2000 OK\r\n\r\n", "bad status line"),
            (b"HTTP/1.1 OK\r\n\r\n", "bad status line"),
            (b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", "bad header line"),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
                "bad Content-Length",
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\n",
                "bad Content-Length",
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
                "conflicting",
            ),
            (
                b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
                "ends after 3 of its 10 bytes",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
                "unsupported Transfer-Encoding",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                "bad chunk size",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffff\r\n",
                "bad chunk size",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffff\r\nabc",
                "cut off after 3",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n",
                "does not end where",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab",
                "cut off",
            ),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                "cut off or too long",
            ),
            (b"HTTP/1.1 200 \xff\r\n\r\n", "not text"),
        ] {
            let e = err(raw);
            assert!(
                e.contains(needle),
                "{:?}: {e}",
                String::from_utf8_lossy(raw)
            );
        }
        // Headers that never end: bounded, named.
        let mut huge = b"HTTP/1.1 200 OK\r\n".to_vec();
        huge.extend(std::iter::repeat_n(b'a', MAX_HEADERS * 2));
        assert!(
            err(&huge).contains("no end of the headers"),
            "{}",
            err(&huge)
        );
        // A chunk size line that never ends.
        let mut long = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        long.extend(std::iter::repeat_n(b'0', 10_000));
        assert!(err(&long).contains("too long"));
        // Garbage of every length never panics.
        let seed = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n4\r\nabcd\r\n0\r\n\r\n";
        for cut in 0..seed.len() {
            let _ = parse_response(&seed[..cut]);
            let mut flipped = seed.to_vec();
            flipped[cut] ^= 0x5a;
            let _ = parse_response(&flipped);
        }
    }

    #[test]
    fn inspect_answers_give_the_id_or_a_clear_error() {
        let found = Response {
            status: 200,
            body: format!(r#"{{"Id":"{ID}","Name":"/agent-1","State":{{}}}}"#).into_bytes(),
        };
        assert!(
            matches!(parse_inspect(&found).unwrap(), Lookup::Found { id, name, .. } if id == ID && name == "agent-1")
        );
        for (status, body, needle) in [
            (200, r#"{"Id":"abc"}"#.to_string(), "no container id"),
            (
                200,
                format!(r#"{{"Id":"{}"}}"#, ID.to_uppercase()),
                "no container id",
            ),
            (
                200,
                r#"{"Id":"../../etc/passwd"}"#.into(),
                "no container id",
            ),
            (200, r#"[1,2"#.into(), "not JSON"),
            (200, r#"{}"#.into(), "no container id"),
            (500, r#"{"message":"boom"}"#.into(), "500: boom"),
            (400, "x".repeat(10_000), "400: xxx"),
        ] {
            let e = parse_inspect(&Response {
                status,
                body: body.into_bytes(),
            })
            .unwrap_err();
            assert!(e.contains(needle), "{e}");
            assert!(e.len() < 400, "an error stays short: {}", e.len());
        }
    }

    #[test]
    fn an_exited_containers_process_comes_from_its_inspect_document() {
        let doc = serde_json::json!({
            "Id": ID, "Path": "/init", "Args": ["sleep", "infinity"],
            "Config": {"Env": ["PATH=/bin", "HOSTNAME=3f4e2b0c9d1a"], "WorkingDir": "/app",
                       "Hostname": "3f4e2b0c9d1a"},
            "GraphDriver": {"Name": "overlay2", "Data": {"MergedDir": "/d/overlay2/x/merged"}},
        });
        assert_eq!(
            spec_from_inspect(&doc),
            serde_json::json!({
                "hostname": "3f4e2b0c9d1a",
                "process": {"args": ["/init", "sleep", "infinity"],
                            "env": ["PATH=/bin", "HOSTNAME=3f4e2b0c9d1a"], "cwd": "/app"},
                "root": {"path": "/d/overlay2/x/merged"},
            })
        );
        // Missing or odd fields are left out, never guessed.
        for junk in [
            serde_json::json!({}),
            serde_json::json!({"Path": "", "Args": []}),
            serde_json::json!({"Path": "/x", "Args": [1]}),
            serde_json::json!({"Config": "x", "GraphDriver": {"Data": null}}),
        ] {
            assert_eq!(
                spec_from_inspect(&junk),
                serde_json::json!({"process": {}}),
                "{junk}"
            );
        }
    }

    #[test]
    fn docker_host_and_names() {
        assert_eq!(
            socket_path(None).unwrap(),
            PathBuf::from("/var/run/docker.sock")
        );
        assert_eq!(
            socket_path(Some("")).unwrap(),
            PathBuf::from("/var/run/docker.sock")
        );
        assert_eq!(
            socket_path(Some("unix:///tmp/d/docker.sock")).unwrap(),
            PathBuf::from("/tmp/d/docker.sock")
        );
        for bad in [
            "tcp://1.2.3.4:2375",
            "ssh://host",
            "unix://rel.sock",
            "/tmp/x",
        ] {
            assert!(socket_path(Some(bad)).is_err(), "{bad}");
        }
        for name in ["agent", "/agent", "a.b_c-1", ID, "3f4e"] {
            assert!(is_docker_name(name), "{name}");
        }
        for name in [
            "", "/", "-x", "_x", "a/b", "a b", "a?b", "a%2fb", "../x", "é",
        ] {
            assert!(!is_docker_name(name), "{name}");
        }
        assert!(!is_docker_name(&"a".repeat(256)));
        // Not a name: nothing is asked (no socket needed).
        assert_eq!(lookup(Some("tcp://x"), "a/b").unwrap(), Lookup::NotFound);
    }

    #[test]
    fn a_dockerd_that_answers_too_much_or_nothing_is_an_error() {
        use std::os::unix::net::UnixListener;
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("d.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        let server = std::thread::spawn(move || {
            // 1: endless body; 2: a proper answer; 3: closes without answering.
            let (mut c, _) = listener.accept().unwrap();
            let mut req = [0u8; 1024];
            let n = c.read(&mut req).unwrap();
            let req = String::from_utf8_lossy(&req[..n]).into_owned();
            let _ = c.write_all(b"HTTP/1.1 200 OK\r\n\r\n");
            let chunk = vec![b'x'; 1 << 16];
            while c.write_all(&chunk).is_ok() {}
            let (mut c, _) = listener.accept().unwrap();
            let _ = c.read(&mut [0u8; 1024]).unwrap();
            let body = format!(r#"{{"Id":"{ID}","Name":"/n"}}"#);
            write!(
                c,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            drop(c);
            let (mut c, _) = listener.accept().unwrap();
            let _ = c.read(&mut [0u8; 1024]).unwrap();
            drop(c);
            req
        });
        let host = format!("unix://{}", sock.display());
        let e = lookup(Some(&host), "n").unwrap_err();
        assert!(e.contains("more than"), "{e}");
        assert!(
            matches!(lookup(Some(&host), "n").unwrap(), Lookup::Found { id, name, .. } if id == ID && name == "n")
        );
        let e = lookup(Some(&host), "n").unwrap_err();
        assert!(e.contains("ends within its headers"), "{e}");
        let req = server.join().unwrap();
        assert!(
            req.starts_with("GET /containers/n/json HTTP/1.1\r\n"),
            "{req}"
        );
        let e = lookup(
            Some(&format!("unix://{}", dir.path().join("none").display())),
            "n",
        )
        .unwrap_err();
        assert!(e.contains("cannot connect to dockerd"), "{e}");
    }
}
