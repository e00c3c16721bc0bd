//! Network namespaces made for one test, and running a test's body inside one.

use std::path::PathBuf;

/// Runs `ip` with `args` and insists it succeeds.
pub fn run_ip(args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A network namespace made for one test, with bridges standing in for sandbox VNets; deleted
/// on drop. Tests that boot VMs or touch the VNet run inside one (see [`inside`]), so the
/// host's own network is never changed.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(tag: &str, bridges: &[&str]) -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let name = format!("cs{tag}{}", id.get(..6).unwrap());
        run_ip(&["netns", "add", &name]);
        run_ip(&["-n", &name, "link", "set", "lo", "up"]);
        for bridge in bridges {
            run_ip(&["-n", &name, "link", "add", bridge, "type", "bridge"]);
            run_ip(&["-n", &name, "link", "set", bridge, "up"]);
        }
        Self { name }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// Runs `body` on a thread moved into network namespace `ns`, on a runtime of that thread
/// alone: the in-process connector, the tools it starts, its sockets and the test's client all
/// live in that namespace.
pub fn inside<F, Fut>(ns: &str, body: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let path = PathBuf::from("/run/netns").join(ns);
    let handle = std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap();
        rustix::thread::move_into_link_name_space(
            std::os::fd::AsFd::as_fd(&file),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(body());
    });
    if let Err(panic) = handle.join() {
        std::panic::resume_unwind(panic);
    }
}
