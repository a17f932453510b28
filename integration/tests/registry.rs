//! Another node: a checkpoint image exported on this node and pushed to a registry on
//! 127.0.0.1 (Debian's `docker-registry`) restores in a second private containerd with its
//! own root, state and socket, as a normal `ctr images pull` and `ctr run`: files, the
//! processes, a server still answering and an interpreter's variables.

use crab_integration::{
    ctr::Ctr,
    node::Node,
    registry::Registry,
    sandbox::{Sandbox, SandboxOptions},
};

#[tokio::test(flavor = "multi_thread")]
async fn a_pushed_checkpoint_restores_on_another_node() {
    let registry = Registry::start();
    let (mut s, _guard) = Sandbox::start("registry", SandboxOptions::default()).await;
    s.run("mkdir -p proj && echo 'made on node 1' > proj/notes.txt")
        .await;
    s.end_turn().await;
    s.run(
        "nohup python3 -c 'import http.server as h; h.ThreadingHTTPServer((\"127.0.0.1\", 8000), h.SimpleHTTPRequestHandler).serve_forever()' \
         >/dev/null 2>&1 & \
         nohup python3 -c 'import socket; secret = [i * i for i in range(1000)]; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((\"127.0.0.1\", 9000)); s.listen(); [c.sendall(str(sum(secret)).encode()) or c.close() for c, _ in iter(s.accept, None)]' \
         >/dev/null 2>&1 & \
         for i in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/9000) 2>/dev/null && break; sleep 0.05; done",
    )
    .await;
    s.end_turn().await;
    s.sync().await;
    let reference = format!("{}/crab/registry-test:{}", registry.addr, s.id);
    let (code, out, err) = s.crabctl(&["export", &s.id, &reference]);
    assert_eq!(code, 0, "export: {out}{err}");
    let ctr1 = s.h.ctr();
    ctr1.run(&["images", "push", "--plain-http", &reference])
        .unwrap()
        .ok()
        .unwrap();

    let home =
        s.h.env
            .crab_home
            .join(format!("node2-{}", std::process::id()));
    let node = Node::start(&home);
    let ctr2 = Ctr::new(&node.env);
    ctr2.run(&["images", "pull", "--plain-http", &reference])
        .unwrap()
        .ok()
        .unwrap();
    let config = home.join("crab.toml");
    // Node 2 has a signing key of its own: node 1's image is not signed by a key it trusts.
    std::fs::write(
        &config,
        format!(
            "[store]\nstate_dir = \"{}\"\n",
            home.join("state").display()
        ),
    )
    .unwrap();
    let refused = ctr2
        .run(&[
            "run",
            "-d",
            "--runtime",
            "io.containerd.crab.v1",
            "--runtime-config-path",
            config.to_str().unwrap(),
            &reference,
            "untrusted-on-node-2",
        ])
        .unwrap();
    assert_ne!(
        refused.code(),
        0,
        "node 2 restored an image signed by a key it does not trust: {refused:?}"
    );
    assert!(
        format!("{refused:?}").contains("not signed by a trusted key"),
        "{refused:?}"
    );
    let _ = ctr2.run(&["containers", "rm", "untrusted-on-node-2"]);
    // Trusting node 1's public key (as a cluster would, from a Secret on every node) restores it.
    let node1_key = s.state_dir.join("keys/checkpoint-signing.pub");
    std::fs::write(
        &config,
        format!(
            "[store]\nstate_dir = \"{}\"\n[restore]\ntrusted_keys = [\"{}\"]\n",
            home.join("state").display(),
            node1_key.display()
        ),
    )
    .unwrap();
    let id = "restored-on-node-2";
    ctr2.run(&[
        "run",
        "-d",
        "--runtime",
        "io.containerd.crab.v1",
        "--runtime-config-path",
        config.to_str().unwrap(),
        &reference,
        id,
    ])
    .unwrap()
    .ok()
    .unwrap();
    let check = "cat /app/proj/notes.txt; ls -a / | grep -c crab-checkpoint; ps -eo args --no-headers | grep '^python3' | sort; \
                 python3 -c 'import urllib.request as u; print(u.urlopen(\"http://127.0.0.1:8000/proj/notes.txt\").read().decode().strip())'";
    let out = ctr2
        .run(&[
            "tasks",
            "exec",
            "--exec-id",
            "check",
            id,
            "bash",
            "-c",
            check,
        ])
        .unwrap();
    assert!(
        out.stdout.contains("made on node 1\n0\n"),
        "files restored, reserved dir hidden: {out:?}"
    );
    assert!(
        out.stdout.contains("python3 -c import http.server"),
        "the server process: {out:?}"
    );
    assert!(
        out.stdout.contains("secret = [i * i"),
        "the interpreter process: {out:?}"
    );
    assert!(
        out.stdout.trim_end().ends_with("made on node 1"),
        "the server answers: {out:?}"
    );
    // The interpreter's memory: it answers from the list it built on node 1.
    let probe = "python3 -c 'import socket; c = socket.create_connection((\"127.0.0.1\", 9000)); print(c.recv(100).decode())'";
    let out = ctr2
        .run(&[
            "tasks",
            "exec",
            "--exec-id",
            "probe",
            id,
            "bash",
            "-c",
            probe,
        ])
        .unwrap();
    assert_eq!(
        out.stdout.trim(),
        (0..1000u64).map(|i| i * i).sum::<u64>().to_string(),
        "{out:?}"
    );
    // Its lineage on node 2 begins with the restored checkpoint (recorded in the background, as
    // it imports the process image: the container did not wait for it).
    let origin = home
        .join("state/crab-test")
        .join(id)
        .join("checkpoints/000001.json");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !origin.exists() && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let origin: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&origin).unwrap()).unwrap();
    assert_eq!(origin["kind"], "restored", "{origin:#}");
    assert!(origin["process"]["image"].is_string(), "{origin:#}");
    assert!(
        origin["explanation"].as_str().unwrap().contains(&s.id),
        "{origin:#}"
    );

    drop(node);
    let _ = std::fs::remove_dir_all(&home);
    let _ = ctr1.run(&["images", "rm", &reference]);
    drop(registry);
    s.finish().await;
}
