//! Docker Engine as a client of crab: recognising the containers dockerd owns, and asking
//! dockerd which container a name (or an id prefix) stands for.
//!
//! dockerd runs its containers in containerd namespace [`NAMESPACE`] (`moby`); the container
//! records carry no image and no snapshot, and the container's name lives only in dockerd. A
//! name is resolved with one `GET /containers/{name}/json` over dockerd's unix socket
//! (`DOCKER_HOST`, default [`DEFAULT_HOST`]), spoken by hyper's HTTP/1.1 client. The response
//! is hostile input: hyper parses it (framing, lengths, chunks), its body is bounded
//! ([`MAX_RESPONSE`]), the whole exchange has a deadline ([`TIMEOUT`]), and anything that is not
//! a well-formed answer is an error, never a guess.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use http_body_util::BodyExt as _;

use containerd_client::services::v1::Container;
use serde_json::Value;

/// The containerd namespace dockerd runs its containers in.
pub const NAMESPACE: &str = "moby";
/// The label dockerd puts on every container record it creates (its bundle directory).
pub const LABEL_BUNDLE: &str = "com.docker/engine.bundle.path";
/// Where Docker's clients find dockerd without `DOCKER_HOST`.
pub const DEFAULT_HOST: &str = "unix:///var/run/docker.sock";
/// Bound on the body of a response from dockerd: an inspect document is a few KiB. (hyper
/// bounds the headers: 100 of them, ~400 KiB.)
pub const MAX_RESPONSE: usize = 4 << 20;
/// How long dockerd may take to connect, accept the request and answer it whole.
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

/// Sends `GET path` to dockerd at `socket` and reads the whole response (a body of at most
/// [`MAX_RESPONSE`] bytes, all within [`TIMEOUT`]).
pub async fn get(socket: &Path, path: &str) -> Result<Response, String> {
    get_within(socket, path, TIMEOUT).await
}

async fn get_within(socket: &Path, path: &str, timeout: Duration) -> Result<Response, String> {
    let at = socket.display();
    match tokio::time::timeout(timeout, exchange(socket, path)).await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(format!("dockerd at {at}: {e}")),
        Err(_) => Err(format!("dockerd at {at} did not answer within {timeout:?}")),
    }
}

/// One request on a connection of its own (dockerd's API over its unix socket).
async fn exchange(socket: &Path, path: &str) -> Result<Response, String> {
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| format!("cannot connect to dockerd: {e}"))?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| format!("cannot speak HTTP: {e}"))?;
    let request = hyper::Request::get(path)
        .header(hyper::header::HOST, "docker")
        .header(hyper::header::USER_AGENT, "crabctl")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|e| format!("bad request {path:.80}: {e}"))?;
    let answered = async {
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| format!("no answer: {e}"))?;
        let status = response.status().as_u16();
        let body = http_body_util::Limited::new(response.into_body(), MAX_RESPONSE)
            .collect()
            .await
            .map_err(
                |e| match e.downcast_ref::<http_body_util::LengthLimitError>() {
                    Some(_) => format!("answered with more than {MAX_RESPONSE} bytes"),
                    None => format!("the answer's body: {e}"),
                },
            )?
            .to_bytes();
        Ok(Response {
            status,
            body: body.to_vec(),
        })
    };
    // The connection is driven here, beside the request (not in a task of its own): whatever
    // way this returns, the socket is closed with it.
    tokio::pin!(answered, connection);
    tokio::select! {
        r = &mut answered => r,
        c = &mut connection => match c {
            Err(e) => Err(format!("the connection: {e}")),
            // Closed after a whole answer: what was read is the answer.
            Ok(()) => answered.await,
        },
    }
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
pub async fn lookup(docker_host: Option<&str>, name: &str) -> Result<Lookup, String> {
    if !is_docker_name(name) {
        return Ok(Lookup::NotFound);
    }
    let socket = socket_path(docker_host)?;
    parse_inspect(&get(&socket, &format!("/containers/{name}/json")).await?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read as _, Write as _};

    const ID: &str = "3f4e2b0c9d1a8e7f6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a";

    /// What the fake dockerd does with one connection.
    enum Answer {
        /// Writes these bytes and closes.
        Raw(Vec<u8>),
        /// A 200 whose body never ends.
        Endless,
        /// Reads the request and says nothing for 2 s.
        Silent,
    }

    /// A dockerd at `<dir>/d.sock` answering its connections in turn; the thread returns the
    /// request heads it read.
    fn fake_dockerd(
        dir: &Path,
        answers: Vec<Answer>,
    ) -> (String, std::thread::JoinHandle<Vec<String>>) {
        let sock = dir.join("d.sock");
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let server = std::thread::spawn(move || {
            let mut requests = Vec::new();
            for answer in answers {
                let (mut c, _) = listener.accept().unwrap();
                let mut req = Vec::new();
                let mut buf = [0u8; 1024];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match c.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                requests.push(String::from_utf8_lossy(&req).into_owned());
                match answer {
                    Answer::Raw(bytes) => {
                        let _ = c.write_all(&bytes);
                    }
                    Answer::Endless => {
                        let _ = c.write_all(b"HTTP/1.1 200 OK\r\n\r\n");
                        let chunk = vec![b'x'; 1 << 16];
                        while c.write_all(&chunk).is_ok() {}
                    }
                    Answer::Silent => std::thread::sleep(Duration::from_secs(2)),
                }
            }
            requests
        });
        (format!("unix://{}", sock.display()), server)
    }

    fn inspect_answer(id: &str, name: &str) -> Vec<u8> {
        let body = format!(r#"{{"Id":"{id}","Name":"/{name}"}}"#);
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    }

    #[tokio::test]
    async fn length_chunked_and_close_delimited_answers_are_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        let body = format!(r#"{{"Id":"{ID}","Name":"/agent"}}"#);
        let (a, b) = body.split_at(10);
        let chunked = format!(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n{:x}\r\n{a}\r\n{:x};x=y\r\n{b}\r\n0\r\n\r\n",
            a.len(),
            b.len()
        );
        let (host, server) = fake_dockerd(
            dir.path(),
            vec![
                Answer::Raw(inspect_answer(ID, "agent")),
                Answer::Raw(chunked.into_bytes()),
                Answer::Raw(
                    b"HTTP/1.0 404 Not Found\r\n\r\n{\"message\":\"No such container: x\"}"
                        .to_vec(),
                ),
            ],
        );
        for _ in 0..2 {
            let found = lookup(Some(&host), "agent").await.unwrap();
            assert!(
                matches!(&found, Lookup::Found { id, name, .. } if id == ID && name == "agent"),
                "{found:?}"
            );
        }
        assert_eq!(lookup(Some(&host), "x").await.unwrap(), Lookup::NotFound);
        let requests = server.join().unwrap();
        assert!(
            requests[0].starts_with("GET /containers/agent/json HTTP/1.1\r\n"),
            "{}",
            requests[0]
        );
        let head = requests[0].to_ascii_lowercase();
        assert!(head.contains("host: docker\r\n") && head.contains("user-agent: crabctl"));
    }

    /// Every malformed, cut-off or oversized answer is an error naming dockerd, never a guess
    /// and never a hang.
    #[tokio::test]
    async fn hostile_answers_are_errors_not_guesses() {
        let raw = |b: &[u8]| Answer::Raw(b.to_vec());
        let mut huge_head = b"HTTP/1.1 200 OK\r\n".to_vec();
        huge_head.extend(std::iter::repeat_n(b'a', 1 << 20));
        let mut long_chunk_line = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        long_chunk_line.extend(std::iter::repeat_n(b'0', 10_000));
        let answers = vec![
            raw(b""),
            raw(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n"),
            raw(b"SSH-2.0-OpenSSH\r\n\r\n"),
            raw(b"HTTP/1.1 2000 OK\r\n\r\n"),
            raw(b"HTTP/1.1 OK\r\n\r\n"),
            raw(b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n"),
            raw(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n"),
            raw(b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\n"),
            raw(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab"),
            raw(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"),
            raw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n\x1f\x8b"),
            raw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"),
            raw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n"),
            raw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffff\r\nabc"),
            raw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n"),
            raw(b"HTTP/1.1 200 \xff\r\n\r\n"),
            Answer::Raw(huge_head),
            Answer::Raw(long_chunk_line),
            Answer::Endless,
        ];
        let n = answers.len();
        let dir = tempfile::tempdir().unwrap();
        let (host, server) = fake_dockerd(dir.path(), answers);
        for i in 0..n {
            let e = lookup(Some(&host), "n")
                .await
                .expect_err(&format!("answer {i} is refused"));
            assert!(e.contains("dockerd"), "answer {i}: {e}");
            assert!(e.len() < 600, "answer {i}: an error stays short: {e}");
            if i == n - 1 {
                assert!(e.contains("more than"), "the endless body: {e}");
            }
        }
        assert_eq!(server.join().unwrap().len(), n);
    }

    /// A dockerd that takes the request and never answers is given up on at the deadline.
    #[tokio::test]
    async fn a_silent_dockerd_is_given_up_on() {
        let dir = tempfile::tempdir().unwrap();
        let (host, server) = fake_dockerd(dir.path(), vec![Answer::Silent]);
        let socket = socket_path(Some(&host)).unwrap();
        let e = get_within(&socket, "/containers/n/json", Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(e.contains("did not answer within"), "{e}");
        server.join().unwrap();
        let e = lookup(
            Some(&format!("unix://{}", dir.path().join("none").display())),
            "n",
        )
        .await
        .unwrap_err();
        assert!(e.contains("cannot connect to dockerd"), "{e}");
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

    #[tokio::test]
    async fn docker_host_and_names() {
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
        assert_eq!(
            lookup(Some("tcp://x"), "a/b").await.unwrap(),
            Lookup::NotFound
        );
    }
}
