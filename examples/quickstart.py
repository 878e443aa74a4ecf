import asyncio
from opendsec import DSecClient, DSecRunArgs
async def main():
    async with DSecClient() as client:   # reads DSEC_API_URL, DSEC_API_KEY
        sb = await client.run_sandbox(DSecRunArgs(backend="microvm", image="root/py:3.11",
                                                  cpu_cores_limit=1, memory_limit_mb=1024))
        print((await sb.run_shell("python3 -c 'print(6*7)'")).stdout.strip())
        await sb.stop()
asyncio.run(main())
