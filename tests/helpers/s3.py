"""A real S3 API server for a test: moto's server mode (`moto_server`, from the `moto[server]` pip
package), started as a process on a free loopback port, with IAM authorization on.

Why moto: it is the S3 API server a pip package provides (MinIO is a Go binary, LocalStack a
container: neither installs here), it speaks the REST API the AWS SDK inside pyarrow uses
(multipart uploads, HEAD, ListObjectsV2, DeleteObject), and with INITIAL_NO_AUTH_ACTION_COUNT it
checks every request's signature and its user's IAM policy (resources and explicit denies
included), so a test can give the fleet's driver and the cluster's nodes the credentials they
would have in production, and revoke a write mid-run with a bucket policy.

Users (each with its own access key):
  admin   s3:* on everything: the test itself (uploading bags, deleting one, bucket policies)
  node    what a cluster node needs: read bags, read and write runs and reports
  driver  what the person running `fleet eval` needs: list bags and read list files, read and
          write runs, and NOT read a bag's data (*.mcap, *.db3): a driver that read a bag's bytes
          would be refused, so a run that passes shows none went through the driver

Also a script: `cd tests && python -m helpers.s3` starts one and prints the environment to use.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from helpers.ray import free_ports

MOTO = Path(sys.executable).parent / "moto_server"
BUCKETS = ("bags", "runs", "reports")
REGION = "us-east-1"


def _policy(*statements) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": list(statements)})


def _arns(bucket: str) -> list[str]:
    return [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]


POLICIES = {
    "admin": _policy({"Effect": "Allow", "Action": "s3:*", "Resource": "*"}),
    "node": _policy({"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": _arns("bags")},
                    {"Effect": "Allow", "Action": "s3:*", "Resource": _arns("runs") + _arns("reports")}),
    "driver": _policy({"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": _arns("bags")},
                      {"Effect": "Deny", "Action": "s3:GetObject",
                       "Resource": ["arn:aws:s3:::bags/*.mcap", "arn:aws:s3:::bags/*.db3"]},
                      {"Effect": "Allow", "Action": "s3:*", "Resource": _arns("runs") + _arns("reports")}),
}


@dataclass
class S3Server:
    endpoint: str
    keys: dict[str, tuple[str, str]] = field(default_factory=dict)      # user -> (access key id, secret)
    process: subprocess.Popen | None = None

    def env(self, user: str) -> dict[str, str]:
        """The environment a process of `user` runs with (pyarrow's S3 client reads it)."""
        key, secret = self.keys[user]
        return {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": REGION,
                "AWS_REGION": REGION, "AWS_ENDPOINT_URL": self.endpoint, "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self, user: str = "admin", service: str = "s3"):
        import boto3

        key, secret = self.keys[user]
        return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=key,
                            aws_secret_access_key=secret)

    def upload(self, local: Path, uri: str) -> None:
        """A local bag (a folder, or a .mcap/.db3 file) to s3://bucket/key."""
        bucket, _, key = uri[len("s3://"):].partition("/")
        s3 = self.client()
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for f in files:
            s3.upload_file(str(f), bucket, key if local.is_file() else f"{key}/{f.relative_to(local).as_posix()}")

    def delete(self, uri: str) -> None:
        bucket, _, key = uri[len("s3://"):].partition("/")
        s3 = self.client()
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=key).get("Contents", [])
        for obj in listed:
            if obj["Key"] == key or obj["Key"].startswith(key.rstrip("/") + "/"):
                s3.delete_object(Bucket=bucket, Key=obj["Key"])

    def refuse_writes(self, bucket: str, on: bool = True) -> None:
        """Every PutObject into `bucket` denied (a bucket policy), or allowed again."""
        s3 = self.client()
        if on:
            s3.put_bucket_policy(Bucket=bucket, Policy=_policy(
                {"Effect": "Deny", "Principal": "*", "Action": "s3:PutObject", "Resource": f"arn:aws:s3:::{bucket}/*"}))
        else:
            s3.delete_bucket_policy(Bucket=bucket)


def _wait_up(endpoint: str, process: subprocess.Popen, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if process.poll() is not None:
            raise RuntimeError(f"moto_server exited with {process.returncode}")
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2)
            return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"moto_server did not answer at {endpoint} within {timeout:.0f} s")


@contextmanager
def s3_server():
    """A moto S3 server with the users above and the buckets bags, runs, reports."""
    port = free_ports(1)[0]
    endpoint = f"http://127.0.0.1:{port}"
    setup_actions = 3 * len(POLICIES)          # create_user, create_access_key, put_user_policy, per user
    env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(setup_actions))
    process = subprocess.Popen([str(MOTO), "-H", "127.0.0.1", "-p", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    server = S3Server(endpoint, process=process)
    try:
        _wait_up(endpoint, process)
        import boto3

        iam = boto3.client("iam", endpoint_url=endpoint, region_name=REGION, aws_access_key_id="setup",
                           aws_secret_access_key="setup")
        for user, policy in POLICIES.items():
            iam.create_user(UserName=user)
            key = iam.create_access_key(UserName=user)["AccessKey"]
            iam.put_user_policy(UserName=user, PolicyName="fleet-test", PolicyDocument=policy)
            server.keys[user] = (key["AccessKeyId"], key["SecretAccessKey"])
        for bucket in BUCKETS:
            server.client().create_bucket(Bucket=bucket)
        yield server
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


if __name__ == "__main__":
    with s3_server() as s3:
        for user in ("driver", "node"):
            print(f"# {user}:\n" + "\n".join(f"export {k}={v}" for k, v in s3.env(user).items()))
        print("# Ctrl-C stops it", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
